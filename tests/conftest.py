"""Shared fixtures: a tiny random Llama target (real tokenizer of the default target), a small
conversation file, and the real default target for the slower end-to-end tests."""

import json
import os
import shutil

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

import pytest
import torch


@pytest.fixture(scope="session")
def default_target_dir():
    from speculators.assets import default_target_dir

    return default_target_dir()


def make_tiny_target(out, tokenizer_dir):
    """A 2-layer random Llama with the given tokenizer and its vocab, saved to `out`."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                      max_position_embeddings=1024, initializer_range=0.2, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # varied greedy paths and moderately peaked distributions, unlike the default init
        model.model.embed_tokens.weight.normal_(0, 1.0)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    """The default target's tokenizer on a tiny random Llama. SPECULATORS_TINY_TARGET names one
    made earlier by make_tiny_target (the GPU machine has no copy of the default target)."""
    if os.environ.get("SPECULATORS_TINY_TARGET"):
        return os.environ["SPECULATORS_TINY_TARGET"]
    from speculators.assets import default_target_dir

    return make_tiny_target(tmp_path_factory.mktemp("tiny-target"), default_target_dir())


@pytest.fixture(scope="module")
def module_dir(tmp_path_factory, request):
    """Scratch space for one module's fixtures, deleted when the module ends, so their checkpoints (GBs in
    test_checkpoint_faults) never pile up on disk across the suite."""
    path = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
    yield path
    shutil.rmtree(path, ignore_errors=True)


CONVERSATIONS = [
    ("What is the capital of France?", "The capital of France is Paris. It is known for the Eiffel Tower."),
    ("Write a haiku about the sea.", "Waves fold into foam,\nsalt wind carries gull voices,\nthe tide keeps its time."),
    ("Explain recursion briefly.", "Recursion is when a function calls itself on a smaller piece of the problem "
                                   "until it reaches a base case that it can answer directly."),
    ("List three primary colors.", "Red, blue and yellow are the three traditional primary colors in painting."),
    ("How do I reverse a list in Python?", "Use my_list.reverse() to reverse in place, or my_list[::-1] to get a "
                                           "reversed copy of the list without changing the original."),
    ("What does HTTP stand for?", "HTTP stands for HyperText Transfer Protocol, the foundation of data "
                                  "communication on the World Wide Web."),
]


@pytest.fixture(scope="session")
def chat_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "chats.jsonl"
    with open(out, "w") as f:
        for i in range(24):
            q, a = CONVERSATIONS[i % len(CONVERSATIONS)]
            f.write(json.dumps({"conversations": [{"from": "human", "value": q + f" (#{i})"},
                                                  {"from": "gpt", "value": a}]}) + "\n")
    return out


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    """A private tokenized-data cache, so tests never read each other's cached sets."""
    from speculators import assets

    real = assets.cache_dir()
    cache = tmp_path / "cache"
    cache.mkdir()
    # models and wheels stay shared (they are read-only inputs); tokenized data sets do not
    for name in ("models", "assets", "wheels"):
        (cache / name).symlink_to(real / name)
    monkeypatch.setenv("SPECULATORS_CACHE", str(cache))
    return cache
