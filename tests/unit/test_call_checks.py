"""A model call on a GPU worker checks its token ids against the model's vocabulary
before the forward (appliance/call_checks.py): CUDA's embedding asserts on the device,
which loses the worker's context for every session on it."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from djinn.appliance import call_checks
from djinn.errors import ExecutionError


@pytest.fixture(scope="module")
def model():
    cfg = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=32)
    return GPT2LMHeadModel(cfg).eval()


def test_token_ids_within_the_vocabulary_pass_and_the_cpu_agrees(model):
    ids = torch.tensor([[0, 49, 7]])
    call_checks.check(model, "m.forward", (ids,), {})
    call_checks.check(model, "m.forward", (), {"input_ids": ids, "labels": ids})
    call_checks.check(
        model, "m.forward", (), {"input_ids": ids, "labels": torch.tensor([[-100, 3, 4]])}
    )
    model(ids)  # and the forward runs


@pytest.mark.parametrize("bad", [50, -1, 10**9])
def test_a_token_id_past_the_vocabulary_is_refused_as_the_cpu_kernel_refuses(model, bad):
    ids = torch.tensor([[0, bad]])
    for args, kwargs in (((ids,), {}), ((), {"input_ids": ids})):
        with pytest.raises(ExecutionError, match=f"token id {bad}"):
            call_checks.check(model, "m.forward", args, kwargs)
    with pytest.raises(IndexError):
        model(ids)  # the CPU kernel refuses the same ids
    with pytest.raises(ExecutionError, match="labels"):
        call_checks.check(model, "m.forward", (), {"input_ids": ids[:, :1], "labels": ids})


def test_a_module_without_input_embeddings_is_not_checked():
    call_checks.check(torch.nn.Linear(2, 2), "m.forward", (torch.tensor([99]),), {})


# -- Note [positions on a GPU] ----------------------------------------------------------------
def _refused_as_cpu_refuses(model, args, kwargs, match, method="forward"):
    with pytest.raises(ExecutionError, match=match):
        call_checks.check(model, f"m.{method}", args, kwargs)
    # the CPU refuses the same call: its embedding kernel, or (BERT) the slice of a
    # position buffer before it
    with pytest.raises((IndexError, RuntimeError)):
        getattr(model, method)(*args, **kwargs)


def _tiny(config: str, model: str, **fields):
    """A one-layer, width-16, two-head transformers ``model`` (its ``config`` class,
    with ``fields``), in eval mode."""
    import transformers

    cfg = getattr(transformers, config)(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, **fields
    )
    return getattr(transformers, model)(cfg).eval()


def _passes_and_cpu_runs(model, args, kwargs, method="forward"):
    call_checks.check(model, f"m.{method}", args, kwargs)
    getattr(model, method)(*args, **kwargs)


def test_a_prompt_longer_than_the_position_table_is_refused(model):
    _passes_and_cpu_runs(model, (torch.zeros(1, 32, dtype=torch.long),), {})
    _refused_as_cpu_refuses(model, (torch.zeros(1, 33, dtype=torch.long),), {}, "position 32")


def test_a_decode_step_past_the_position_table_is_refused(model):
    with torch.no_grad():
        for step, fits in ((2, True), (3, False)):
            past = model(torch.zeros(1, 30, dtype=torch.long), use_cache=True).past_key_values
            kwargs = {"input_ids": torch.zeros(1, step, dtype=torch.long), "past_key_values": past}
            if fits:
                _passes_and_cpu_runs(model, (), kwargs)
            else:
                _refused_as_cpu_refuses(model, (), kwargs, "position 32, past the model's 32")


@pytest.mark.parametrize("position, fits", [(31, True), (32, False), (-1, False)])
def test_explicit_position_ids_are_checked(model, position, fits):
    kwargs = {"input_ids": torch.zeros(1, 1, dtype=torch.long)}
    kwargs["position_ids"] = torch.tensor([[position]])
    if fits:
        _passes_and_cpu_runs(model, (), kwargs)
    else:
        _refused_as_cpu_refuses(model, (), kwargs, "position")


def test_generate_is_checked_for_the_length_it_may_reach(model):
    prompt = torch.ones(1, 30, dtype=torch.long)  # no padding: positions count from 0
    # three new tokens take two decode steps, at positions 30 and 31
    ok = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0}
    _passes_and_cpu_runs(model, (prompt,), ok, "generate")
    over = {**ok, "max_new_tokens": 4}
    _refused_as_cpu_refuses(model, (prompt,), over, "position 32", "generate")
    call_checks.check(model, "m.generate", (prompt,), {"max_length": 33})
    with pytest.raises(ExecutionError, match="position 38"):
        call_checks.check(model, "m.generate", (prompt,), {"max_length": 40})


def test_bert_positions_and_token_types_are_checked():
    bert = _tiny(
        "BertConfig", "BertModel", intermediate_size=32, vocab_size=50, max_position_embeddings=24
    )
    _passes_and_cpu_runs(bert, (torch.zeros(1, 24, dtype=torch.long),), {})
    _refused_as_cpu_refuses(bert, (torch.zeros(1, 25, dtype=torch.long),), {}, "position 24")
    ids = torch.zeros(1, 4, dtype=torch.long)
    _passes_and_cpu_runs(bert, (ids,), {"token_type_ids": torch.tensor([[0, 1, 1, 0]])})
    _refused_as_cpu_refuses(
        bert, (ids,), {"token_type_ids": torch.tensor([[0, 2, 1, 0]])}, "token_type_ids holds 2"
    )


def test_an_offset_position_table_is_read_less_its_offset():
    opt = _tiny(  # its table has 26 rows, from offset 2
        "OPTConfig",
        "OPTForCausalLM",
        ffn_dim=32,
        vocab_size=50,
        max_position_embeddings=24,
        word_embed_proj_dim=16,
    )
    _passes_and_cpu_runs(opt, (torch.zeros(1, 24, dtype=torch.long),), {})
    _refused_as_cpu_refuses(opt, (torch.zeros(1, 25, dtype=torch.long),), {}, "position 24")


def test_rotary_positions_have_no_table_and_are_not_checked():
    llama = _tiny(
        "LlamaConfig",
        "LlamaForCausalLM",
        num_key_value_heads=2,
        intermediate_size=32,
        vocab_size=50,
        max_position_embeddings=8,
    )
    _passes_and_cpu_runs(llama, (torch.zeros(1, 12, dtype=torch.long),), {})


def test_roberta_positions_count_from_its_padding_index():
    roberta = _tiny(  # positions 2.. of 20 rows: 18 tokens
        "RobertaConfig",
        "RobertaModel",
        vocab_size=100,
        intermediate_size=32,
        max_position_embeddings=20,
    )
    _passes_and_cpu_runs(roberta, (torch.randint(3, 100, (1, 18)),), {})
    _refused_as_cpu_refuses(roberta, (torch.randint(3, 100, (1, 19)),), {}, "position 18")


def _bart():
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(
        vocab_size=100,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=64,
    )
    return BartForConditionalGeneration(cfg).eval()


def test_an_encoder_decoder_counts_its_encoder_and_decoder_apart():
    bart = _bart()
    ids = torch.randint(3, 100, (1, 60))
    new = {"input_ids": ids, "max_new_tokens": 20, "min_new_tokens": 20, "do_sample": False}
    _passes_and_cpu_runs(bart, (), new, "generate")
    _passes_and_cpu_runs(bart, (), {"input_ids": ids, "decoder_input_ids": ids[:, :10]})
    long = {"input_ids": ids[:, :10], "decoder_input_ids": torch.randint(3, 100, (1, 70))}
    _refused_as_cpu_refuses(bart, (), long, "position 69")


def test_a_vocabulary_or_relative_table_the_size_of_the_positions_is_not_a_position_table():
    mistral = _tiny(
        "MistralConfig",
        "MistralForCausalLM",
        vocab_size=64,
        intermediate_size=32,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    _passes_and_cpu_runs(mistral, (torch.randint(0, 64, (1, 80)),), {})
    deberta = _tiny(
        "DebertaV2Config",
        "DebertaV2Model",
        vocab_size=100,
        intermediate_size=32,
        max_position_embeddings=64,
        relative_attention=True,
        position_buckets=32,
        position_biased_input=False,
    )
    _passes_and_cpu_runs(deberta, (torch.randint(3, 100, (1, 100)),), {})


def test_generate_reads_its_own_generation_config_and_a_cache_of_its_prompt(model):
    from transformers import GenerationConfig

    model.generation_config.max_new_tokens = 100
    try:
        ids = torch.ones(1, 8, dtype=torch.long)
        short = GenerationConfig(max_new_tokens=5, do_sample=False, pad_token_id=0)
        _passes_and_cpu_runs(model, (ids,), {"generation_config": short}, "generate")
        long = GenerationConfig(max_new_tokens=100, do_sample=False, pad_token_id=0)
        _refused_as_cpu_refuses(model, (ids,), {"generation_config": long}, "position", "generate")
    finally:
        model.generation_config.max_new_tokens = None
    ids = torch.ones(1, 20, dtype=torch.long)
    with torch.no_grad():
        prefix = model(ids[:, :12], use_cache=True).past_key_values  # a prompt's cached prefix
    kwargs = {"past_key_values": prefix, "max_new_tokens": 12, "do_sample": False}
    _passes_and_cpu_runs(model, (ids,), {**kwargs, "pad_token_id": 0}, "generate")


@pytest.mark.parametrize(
    "setting",
    [
        {"forced_eos_token_id": 50},
        {"forced_bos_token_id": -51},
        {"eos_token_id": [2, 77], "exponential_decay_length_penalty": (0, 1.5)},
    ],
    ids=["forced eos", "forced bos", "penalised eos"],
)
def test_generate_settings_indexing_past_the_vocabulary_are_refused(model, setting):
    """Logits processors index the scores with them (``scores[:, ids] = 0``): on CUDA a
    device-side assert for every session on the worker (a review). The CPU raises
    IndexError where the processor runs (a forced first token only for an
    encoder-decoder's first step: refused here before it could)."""
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ExecutionError, match="outside the model's vocabulary of 50"):
        call_checks.check(model, "m.generate", (ids,), {"max_new_tokens": 4, **setting})
    if "forced_bos_token_id" not in setting:
        with pytest.raises(IndexError):
            model.generate(ids, max_new_tokens=4, pad_token_id=0, **setting)


def test_end_tokens_only_compared_are_not_checked(model):
    """An end token past the vocabulary is compared with the tokens made, never indexed
    with (eager runs it), unless the exponential decay penalises it; a negative forced
    token within the vocabulary counts from its end, as in eager."""
    ids = torch.tensor([[1, 2, 3]])
    for setting in ({"eos_token_id": torch.tensor([1, 60])}, {"forced_bos_token_id": -1}):
        call_checks.check(model, "m.generate", (ids,), {"max_new_tokens": 2, **setting})
        model.generate(ids, max_new_tokens=2, pad_token_id=0, **setting)


def test_a_malformed_autocast_dtype_is_an_invalid_argument():
    """Not an internal error: an unhashable value raised TypeError (a review)."""
    from types import SimpleNamespace

    from djinn.appliance import model_handlers
    from djinn.errors import InvalidArgument

    w = SimpleNamespace(device=SimpleNamespace(torch_device=torch.device("cpu")))
    for bad in ([], {}, "float32", 3):
        with pytest.raises(InvalidArgument, match="autocast"):
            model_handlers._autocast(w, {"autocast": bad})
    with model_handlers._autocast(w, {"autocast": "bfloat16"}):
        assert torch.is_autocast_enabled("cpu")
