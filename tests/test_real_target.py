"""The real default target (SmolLM2-135M-Instruct, fetched by the set-up): GGUF and converted
safetensors agree, the data pipeline masks assistant tokens, and greedy speculative decoding is
lossless on MT-Bench prompts."""

import json

import pytest
import torch

from speculators.assets import fetch
from speculators.data import build_dataset, chat_ids, eval_prompts, iter_json_array
from speculators.proposers import HeadProposer, NgramProposer, SamplingParams, TreeProposer
from speculators.evaluate import evaluate
from speculators.models import MLPSpeculator, MLPSpeculatorConfig
from speculators.target import Target, resolve_model_path


@pytest.fixture(scope="module")
def target():
    return Target.load("smollm2-135m-instruct")


def test_gguf_file_loads_like_the_converted_dir(target):
    gguf = Target.load(str(fetch("smollm2-gguf")))
    ids = torch.tensor([[1, 504, 3458, 314, 260, 3575, 282, 4649, 47]])
    torch.testing.assert_close(gguf(ids).logits, target(ids).logits)


def test_sharded_load_needs_safetensors(tmp_path):
    """shard_target reads safetensors tensor by tensor: a GGUF file or a directory without safetensors
    weights is refused in one line, before any process group is touched."""
    from speculators.assets import AssetError

    with pytest.raises(AssetError, match="GGUF file"):
        Target.load_sharded(str(fetch("smollm2-gguf")), torch.bfloat16, torch.device("cpu"), 2)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    with pytest.raises(AssetError, match="no .safetensors weights"):
        Target.load_sharded(str(bare), torch.bfloat16, torch.device("cpu"), 2)


def test_missing_model_is_a_clear_error(tmp_path):
    from speculators.assets import AssetError

    with pytest.raises(AssetError, match="model not found"):
        resolve_model_path(str(tmp_path / "nothing"))
    with pytest.raises(AssetError, match="Hub is offline"):
        resolve_model_path("someone/some-model")


def test_sharegpt_recovery_and_assistant_mask(tmp_path, target, isolated_cache):
    # a truncated copy: the parser must recover every complete conversation before the cut
    records = [{"id": str(i), "conversations": [{"from": "human", "value": f"question {i}"},
                                                 {"from": "gpt", "value": f"answer number {i} is here"}]}
               for i in range(5)]
    text = json.dumps(records)
    cut = tmp_path / "cut.json"
    cut.write_text(text[: text.index('"id": "4"') + 5])
    assert [r["id"] for r in iter_json_array(cut)] == ["0", "1", "2", "3"]
    ds = build_dataset(str(cut), target.tokenizer, 256, min_tokens=4)
    row = ds[0]
    answer = target.tokenizer.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])
    assert "answer number" in answer and "question" not in answer and "system" not in answer
    assert len(list(iter_json_array(fetch("sharegpt")))) > 17000


def test_greedy_lossless_on_mt_bench(target):
    torch.manual_seed(0)
    mlp = MLPSpeculator(MLPSpeculatorConfig(vocab_size=target.vocab_size, emb_dim=target.hidden_size, n_predict=3))
    mlp.init_from_target(target.model.get_input_embeddings().weight, target.lm_head.weight)
    sp = SamplingParams(max_new_tokens=32)
    proposers = {"mlp": HeadProposer(mlp), "mlp-tree": TreeProposer(mlp), "ngram": NgramProposer()}
    results = evaluate(target, proposers, ["mt-bench", "humaneval"], 3, sp, n_prompts=2)  # raises LosslessnessError on any mismatch
    for d in results["datasets"].values():
        assert d["results"]["ngram"]["tau"] >= 1.0


def test_eval_prompts(target):
    assert len(eval_prompts("mt-bench")) == 80 and len(eval_prompts("humaneval")) == 164
    ids = chat_ids(target.tokenizer, eval_prompts("mt-bench", 1)[0])
    assert target.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
