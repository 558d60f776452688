"""Issue 15: every plug into PyTorch is reference-counted and undoable. Each test runs in
a fresh process: attaching and detaching in the suite's own process would pull the
remote device out from under the other tests."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_unregister_gives_pytorch_back_as_it_was():
    out = _run(
        """
        import os
        os.environ["DJINN_APPLIANCE_PROCESS"] = "1"  # import djinn without registering
        import torch
        from torch._C import _dispatch_has_kernel_for_dispatch_key as has
        import djinn.frontend.extension_points as ep

        import torch.utils._foreach_utils as fu
        from torch.optim.optimizer import _foreach_supported_types as optim_types
        from djinn.frontend.lazy import LazyTensor

        before = (torch.nn.Module.to, len(torch.serialization._package_registry))
        types_before = (list(optim_types), list(fu._foreach_supported_types))
        ep.register()
        assert torch.nn.Module.to is before[0]  # Note [module to]: never replaced
        assert has("aten::_to_copy", "PrivateUse1")
        assert len(torch.serialization._package_registry) == before[1] + 1
        assert LazyTensor in optim_types and LazyTensor in fu._foreach_supported_types
        ep.unregister()
        assert torch.nn.Module.to is before[0]
        assert not has("aten::_to_copy", "PrivateUse1")
        assert not has("aten::mm", "AutocastPrivateUse1")
        assert len(torch.serialization._package_registry) == before[1]
        assert (list(optim_types), list(fu._foreach_supported_types)) == types_before
        ep.register()  # and again: attachments come back
        assert has("aten::_to_copy", "PrivateUse1")
        print("ok")
        """
    )
    assert out == "ok"


def test_attachments_are_reference_counted():
    out = _run(
        """
        import torch
        import djinn
        from djinn.frontend import extension_points as ep

        hooks = torch.nn.modules.module._global_forward_pre_hooks
        n = len(hooks)
        with djinn.capture():
            with djinn.capture():
                assert len(hooks) == n + 1  # one attachment, two holders
            assert len(hooks) == n + 1
        assert len(hooks) == n  # detached with its last holder
        cuda = torch.cuda.is_available
        ep.CUDA_QUERIES.acquire()
        assert torch.cuda.is_available() and torch.cuda.is_available is not cuda
        ep.CUDA_QUERIES.release()
        assert torch.cuda.is_available is cuda
        print("ok")
        """
    )
    assert out == "ok"


def test_meta_parameters_are_scoped_to_the_building_thread():
    out = _run(
        """
        import threading
        import torch
        from djinn.frontend.extension_points import parameters_on_meta

        seen = []
        started, done = threading.Event(), threading.Event()

        def other():
            started.wait()
            seen.append(torch.nn.Linear(2, 2).weight.device.type)
            done.set()

        t = threading.Thread(target=other)
        t.start()
        with parameters_on_meta():
            inside = torch.nn.Linear(2, 2)
            started.set()
            done.wait(30)
        t.join()
        print(inside.weight.device.type, seen[0], torch.nn.Linear(2, 2).weight.device.type)
        """
    )
    assert out == "meta cpu cpu"


def test_dynamo_skips_djinns_files_whether_it_is_imported_before_or_after():
    """Note [dynamo skips djinn]: without paying dynamo's import in `import djinn`."""
    for dynamo_first in (False, True):
        out = _run(
            f"""
            import sys
            import torch
            if {dynamo_first}:
                import torch._dynamo
            import djinn
            import djinn.frontend.extension_points as ep
            print("loaded" if "torch._dynamo" in sys.modules else "not-loaded")
            import torch._dynamo.trace_rules as rules
            print(rules.check_file(ep.__file__).skipped)
            ep.unregister()
            print(rules.check_file(ep.__file__).skipped)
            print(any(type(f).__name__ == "WhenLoaded" for f in sys.meta_path))
            """
        )
        loaded = "loaded" if dynamo_first else "not-loaded"
        assert out.split() == [loaded, "True", "False", "False"], out


def test_dynamo_still_imports_when_one_loader_serves_all_its_modules():
    """A review's case: zipimport's and frozen applications' loaders serve many modules
    with one object; the skip patched onto it ran on every dynamo module after
    trace_rules, and dynamo could not be imported."""
    out = _run(
        """
        import importlib.abc, importlib.machinery, importlib.util, sys
        import torch
        import djinn

        class Shared(importlib.abc.MetaPathFinder, importlib.abc.Loader):
            def find_spec(self, name, path, target=None):
                if not name.startswith("torch._dynamo"):
                    return None
                spec = importlib.machinery.PathFinder.find_spec(name, path)
                if spec is None or type(spec.loader) is not importlib.machinery.SourceFileLoader:
                    return None
                return importlib.util.spec_from_file_location(
                    name, spec.origin, loader=self,
                    submodule_search_locations=spec.submodule_search_locations,
                )

            def create_module(self, spec):
                return None

            def exec_module(self, module):
                with open(module.__spec__.origin) as f:
                    code = compile(f.read(), module.__spec__.origin, "exec")
                exec(code, module.__dict__)

        # after Djinn's finders (they wait for modules and hand them to those after)
        ours = [i for i, f in enumerate(sys.meta_path) if type(f).__name__ == "WhenLoaded"]
        sys.meta_path.insert(max(ours) + 1, Shared())
        import torch._dynamo.trace_rules as rules
        import djinn.frontend.extension_points as ep
        print(torch.compile(lambda x: x * 2 + 1)(torch.ones(2)).tolist())
        print(rules.check_file(ep.__file__).skipped)
        """
    )
    assert out.split("\n") == ["[3.0, 3.0]", "True"], out


def test_compile_wrappers_go_on_whenever_dynamo_is_imported_and_come_off():
    """Note [torch.compile and remote values]: inductor's compile_fx and dynamo's
    clone_input (and the copy the builder imported by name) are wrapped, whether dynamo
    and inductor were imported before djinn or after, without importing either in
    `import djinn`; unregister puts PyTorch's own back."""
    for first in (False, True):
        out = _run(
            f"""
            import sys
            import torch
            if {first}:
                import torch._inductor.compile_fx
            import djinn
            import djinn.frontend.extension_points as ep
            print("loaded" if "torch._inductor.compile_fx" in sys.modules else "not-loaded")
            import torch._inductor.compile_fx as cfx
            import torch._dynamo.utils as du
            import torch._dynamo.variables.builder as b
            originals = (cfx.compile_fx.djinn_original, du.clone_input.djinn_original)
            print(b.clone_input is du.clone_input)
            ep.unregister()
            print(cfx.compile_fx is originals[0], du.clone_input is originals[1])
            print(b.clone_input is originals[1])
            """
        )
        loaded = "loaded" if first else "not-loaded"
        assert out.split() == [loaded, "True", "True", "True", "True"], out


def test_accelerate_fp16_admits_the_remote_device_and_puts_accelerate_back():
    """Note [accelerate's fp16]: imported before or after the attachment, accelerate's fp16
    check lists the remote device while ``djinn run`` holds it, and its code is as it was
    after; an ``__init__`` without the check is left alone."""
    out = _run(
        """
        import sys
        import djinn
        from djinn.frontend import accelerate_fp16, extension_points as ep

        def fp16_devices(cls):
            return [c for c in cls.__init__.__code__.co_consts
                    if isinstance(c, tuple) and "mps" in c]

        ep.ACCELERATE_FP16.acquire()  # before accelerate is imported: on its import
        assert "accelerate.accelerator" not in sys.modules
        from accelerate import Accelerator
        code = Accelerator.__init__.__code__
        assert "remote_accelerator" in fp16_devices(Accelerator)[0]
        ep.ACCELERATE_FP16.release()
        assert "remote_accelerator" not in fp16_devices(Accelerator)[0]
        original = Accelerator.__init__.__code__
        assert original is not code
        ep.ACCELERATE_FP16.acquire()  # accelerate loaded: at once
        assert "remote_accelerator" in fp16_devices(Accelerator)[0]
        ep.ACCELERATE_FP16.release()
        assert Accelerator.__init__.__code__ is original

        class Other:  # an accelerate whose check changed: nothing touched
            def __init__(self):
                self.kinds = ("cuda", "xpu")
        mod = type(sys)("fake")
        mod.Accelerator = Other
        assert accelerate_fp16._admit(mod) is None
        print("ok")
        """
    )
    assert out == "ok"


def test_mapped_generator_makes_cpu_generators_for_the_mapped_device_and_comes_off():
    """``djinn run``'s ``torch.Generator("cuda")`` (mapped_generator.py): a CPU generator,
    PyTorch's own class for isinstance; any other device's as PyTorch makes it; and
    ``torch.Generator`` is PyTorch's again once released."""
    out = _run(
        """
        import torch
        import djinn
        from djinn.frontend import extension_points as ep

        original = torch.Generator
        ep.MAPPED_GENERATOR.acquire()
        for made in (torch.Generator("cuda"), torch.Generator(device="cuda:0"),
                     torch.Generator("remote_accelerator"), torch.Generator()):
            assert type(made) is torch.Generator and made.device.type == "cpu", made
            assert isinstance(made, torch.Generator) and isinstance(made, original)
        assert isinstance(torch.default_generator, torch.Generator)
        assert issubclass(original, torch.Generator)
        assert torch.Generator.manual_seed is original.manual_seed
        assert torch.Generator.__module__ == original.__module__

        class Seeded(torch.Generator):  # a program's own subclass, made as in eager
            def __init__(self, device="cpu"):
                super().__init__()
                self.manual_seed(7)

            def draw(self):
                return torch.rand(2, generator=self)

        mine = Seeded("cuda")
        assert type(mine) is Seeded and mine.initial_seed() == 7
        assert torch.equal(mine.draw(), torch.rand(2, generator=original().manual_seed(7)))
        assert not isinstance(torch.default_generator, Seeded)
        import io, pickle
        back = pickle.loads(pickle.dumps(torch.Generator("cuda").manual_seed(5)))
        assert type(back) is original and back.initial_seed() == 5  # as eager pickles it
        buf = io.BytesIO()
        torch.save({"g": torch.Generator("cuda").manual_seed(6)}, buf)
        buf.seek(0)
        assert torch.load(buf, weights_only=False)["g"].initial_seed() == 6
        assert issubclass(Seeded, torch.Generator) and not issubclass(original, Seeded)
        try:
            torch.Generator("meta")
        except RuntimeError as exc:  # PyTorch's own word on other devices
            assert "meta" in str(exc).lower()
        else:
            raise AssertionError("a meta generator was made")
        ep.MAPPED_GENERATOR.release()
        assert torch.Generator is original
        print("ok")
        """
    )
    assert out == "ok"


def test_storages_refuses_the_remote_device_and_comes_off():
    """``import djinn``'s ``STORAGES`` (storages.py): a storage made on the remote device
    is refused, typed; once released the class is PyTorch's as it was."""
    out = _run(
        """
        import torch
        assert "__new__" not in torch.UntypedStorage.__dict__
        import djinn
        from djinn.errors import UnsupportedOp
        from djinn.frontend import extension_points as ep

        try:
            torch.UntypedStorage(4, device="remote_accelerator:0")
        except UnsupportedOp:
            pass
        else:
            raise AssertionError("a remote storage was made")
        assert torch.UntypedStorage(4).nbytes() == 4
        ep.unregister()
        assert "__new__" not in torch.UntypedStorage.__dict__
        assert torch.UntypedStorage(4).nbytes() == 4
        print("ok")
        """
    )
    assert out == "ok"


def test_legacy_types_come_off():
    """``djinn run``'s ``LEGACY_TYPES`` (legacy_types.py): torch.cuda's legacy types are
    PyTorch's again once released."""
    out = _run(
        """
        import torch
        import djinn
        from djinn.frontend import extension_points as ep

        original = torch.cuda.FloatTensor
        ep.LEGACY_TYPES.acquire()
        x = torch.cuda.FloatTensor(2, 3)
        assert x.device.type == "remote_accelerator" and x.dtype == torch.float32
        ep.LEGACY_TYPES.release()
        assert torch.cuda.FloatTensor is original
        print("ok")
        """
    )
    assert out == "ok"
