"""What ends a completion (issue 54): every end token a model has, and the record of which
one (or which stop string) ended each completion.

A GGUF file declares one end of sequence; the built-in Qwen2.5 files declare `<|im_end|>`
(151645) while Qwen's generation_config.json ends at `<|endoftext|>` (151643) too, and
decoding past it glued text onto finished HumanEval bodies. `end_token_ids` adds the
tokenizer's known end-of-turn special tokens and `generation_config.json`'s ids."""

import json
from pathlib import Path

import pytest

import degs_jax
from degs_jax.models import end_token_ids, load
from degs_jax.models.hf_import import transformers
from degs_jax.text import ended_by

QWEN_ENDS = {151643: "<|endoftext|>", 151645: "<|im_end|>"}
SMOLLM2_ENDS = {0: "<|endoftext|>", 2: "<|im_end|>"}


@pytest.fixture(scope="module")
def smollm2():
    return load("smollm2-135m", progress=False)


@pytest.mark.slow
@pytest.mark.parametrize("name, ends", [("smollm2-135m", SMOLLM2_ENDS), ("qwen2.5-coder-0.5b", QWEN_ENDS)])
def test_the_built_in_models_end_at_each_of_their_end_tokens(name, ends):
    model = load(name, progress=False)
    assert model.eos_ids == tuple(sorted(ends))
    assert {i: model.tokenizer.convert_ids_to_tokens(i) for i in model.eos_ids} == ends
    # the file declares one of them; the other comes from the vocabulary's special tokens
    assert len(model.cfg.eos_token_ids) == 1 and model.cfg.eos_token_ids[0] in ends
    assert end_token_ids(model.tokenizer) == model.eos_ids
    # the converted config names the transformers that wrote it: without it transformers
    # 5.17 warns of an "incorrect regex pattern" on the Qwen tokenizer (docs/benchmarks.md)
    config = json.loads((Path(model.source) / "config.json").read_text())
    assert config["transformers_version"] == transformers().__version__


def test_only_special_tokens_end():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"a": 0, "<|im_end|>": 1, "<|endoftext|>": 2, "<|eos|>": 3}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="a")),
                                        eos_token="<|eos|>")
    assert end_token_ids(tokenizer) == (3,)  # "<|im_end|>" here is a plain vocabulary entry: text
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    assert end_token_ids(tokenizer, declared=(0,)) == (0, 1, 3)
    assert end_token_ids(None, declared=(5, 4)) == (4, 5)


@pytest.mark.parametrize("tokens, ended, stop, decoded, want", [
    ([5, 6, 151643], True, None, "xy", 151643),
    ([5, 6, 151645], True, ("\n",), "x\ny", 151645),  # the end token, not a stop inside the text
    ([5, 6], True, ("\ndef", "\n#"), "f()\n#", "\n#"),
    ([5, 6], True, ("abc", "b"), "xabc", "b"),  # "b" is completed first, inside "abc"
    ([5, 6], True, ("b", "xab"), "xab", "xab"),  # both completed by the last byte: the longer
    ([5, 6], False, ("b",), "xb", None),  # the budget
])
def test_ended_by(tokens, ended, stop, decoded, want):
    assert ended_by(tokens, ended, (151643, 151645), stop, decoded) == want


@pytest.mark.slow
def test_sample_says_what_ended_each_completion(smollm2):
    prompts = ["What is 2+2? Reply with the number only.", "Count: one, two, three"]
    ended = degs_jax.sample(smollm2, prompts, "greedy", max_new_tokens=24).outputs
    assert [o.chosen.ended_by for o in ended] == [2, 2] and all(o.chosen.tokens[-1] == 2 for o in ended)
    assert ended[1].chosen.text == "One: 1\nTwo: 2\nThree: 3"
    (stopped,) = degs_jax.sample(smollm2, prompts[1:], "greedy", max_new_tokens=24, stop=(":", "Two")).outputs
    assert stopped.chosen.ended_by == ":" and stopped.chosen.text == "One"
    (cut,) = degs_jax.sample(smollm2, prompts[1:], "greedy", max_new_tokens=3).outputs
    assert not cut.chosen.ended and cut.chosen.ended_by is None
