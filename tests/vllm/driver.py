"""Run real vLLM on a list of cases and report outputs and vLLM's own spec-decode metrics as JSON.

Runs in the vLLM venv (`.venv-vllm`, made by scripts/setup_vllm.sh), never in the main one:

    .venv-vllm/bin/python tests/vllm/driver.py SPEC.json OUT.json

SPEC.json:
    {"target": DIR, "dtype": "float32", "max_tokens": 64, "prompts": [[token ids], ...],
     "cases": [{"name": "plain", "speculative_config": null, "in_process": true, "needs_exports": false,
                "additional_config": null, "batch_size": null}, ...],   # batch_size: prompts per generate()
     "ready_file": PATH,                  # optional: cases with needs_exports wait until it exists
     "config_checks": {"medusa": DIR, "mlp_speculator": DIR}}   # optional: routing checks, no engine

One case is one `LLM(...)`: `in_process` (the default) puts vLLM's engine core and worker in this
process (VLLM_ENABLE_V1_MULTIPROCESSING=0, executor "uni": ~5 s a start instead of ~25 s); otherwise
vLLM's default multi-process layout, where our plugin is loaded from its entry point in every process.
Cases run one after the other; only one vLLM engine exists at a time.

OUT.json, per case: outputs (token ids per prompt), the speculative method vLLM ended up with, `spec` =
deltas of vLLM's Prometheus counters vllm:spec_decode_num_drafts / _num_draft_tokens /
_num_accepted_tokens / _num_accepted_tokens_per_pos over the generate() call, `per_request` = vLLM's
per-request metrics (per_request_spec_decode_metrics="detailed": accepted and drafted per verify step),
whether the plugin's hooks are installed in this process, and seconds for start-up and generation.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path

from speculators.vllm_plugin.metrics import spec_decode_metrics


def delta(after: dict, before: dict) -> dict:
    pos_b = before["accepted_per_pos"] + [0] * len(after["accepted_per_pos"])
    d = {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    d["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], pos_b)]
    return d


def plugin_state() -> dict:
    """Whether our plugin touched vLLM in this process (it must not, unless an export is involved)."""
    from vllm.engine.arg_utils import EngineArgs

    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
        runner_hook = bool(getattr(GPUModelRunner.propose_draft_token_ids, "_speculators_hook", False))
    except (ImportError, AttributeError):  # a vLLM whose runner the plugin never hooks (V0, <= 0.31)
        runner_hook = False
    return {"config_hook": bool(getattr(EngineArgs.create_speculative_config, "_speculators_hook", False)),
            "runner_hook": runner_hook}


def engine_kwargs(spec: dict, case: dict) -> dict:
    """LLM(...) arguments for this case, limited to those this vLLM knows (the KV-cache size and the
    per-request metrics are vLLM >= 0.32; older CPU builds size the cache from VLLM_CPU_KVCACHE_SPACE)."""
    from vllm.engine.arg_utils import EngineArgs

    in_process = case.get("in_process", True)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    kwargs = dict(model=spec["target"], dtype=spec.get("dtype", "float32"), seed=0, enforce_eager=True,
                  max_model_len=spec.get("max_model_len", 1024), disable_log_stats=False,
                  kv_cache_memory_bytes=spec.get("kv_cache_bytes", 1 << 30), enable_prefix_caching=False)
    if in_process and os.environ.get("VLLM_USE_V1") != "0":  # V0 on CPU always runs its own executor
        kwargs["distributed_executor_backend"] = "uni"
    if case.get("additional_config") is not None:
        kwargs["additional_config"] = dict(case["additional_config"])
    if case.get("speculative_config") is not None:
        kwargs["speculative_config"] = dict(case["speculative_config"])
        # Per-request acceptance (vLLM >= 0.32): every verify step's accepted count, per prompt.
        kwargs["per_request_spec_decode_metrics"] = "detailed"
    known = EngineArgs.__dataclass_fields__
    if "kv_cache_memory_bytes" not in known:  # GiB, read by the CPU worker
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, kwargs["kv_cache_memory_bytes"] >> 30)))
    return {k: v for k, v in kwargs.items() if k in known}


def backport_v0_cpu_fixes() -> None:
    """vLLM 0.9's two fixes to V0 speculative decoding, applied to vLLM 0.8 in this process (the
    version matrix runs each 0.8 case without them first, which records the failures):
    - every 5 s its metrics collector copies the sampler's counters on a CUDA stream
      (vllm/spec_decode/metrics.py: torch.cuda.current_stream), which a CPU has not; 0.9 asks the
      platform. Here the collector never starts a copy: this driver reads the counters directly.
    - MultiStepWorker asks for the sampler's probabilities on the runner's sampler only, not on a
      model's own (MLPSpeculator's), which then returns none (vllm/spec_decode/multi_step_worker.py)."""
    from vllm.spec_decode import metrics, multi_step_worker

    metrics.AsyncMetricsCollector.__init__.__defaults__ = (None, float("inf"))
    worker = multi_step_worker.MultiStepWorker

    def also_the_models(name):
        runner_only = getattr(worker, name)

        def method(self):
            runner_only(self)
            if hasattr(self.model_runner.model, "sampler"):
                setattr(self.model_runner.model.sampler, flag, True)

        flag = {"set_include_gpu_probs_tensor": "include_gpu_probs_tensor",
                "set_should_modify_greedy_probs_inplace": "should_modify_greedy_probs_inplace"}[name]
        setattr(worker, name, method)

    also_the_models("set_include_gpu_probs_tensor")
    also_the_models("set_should_modify_greedy_probs_inplace")


def run_case(spec: dict, case: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if case.get("backport_v0_cpu_fixes"):
        backport_v0_cpu_fixes()
    kwargs = engine_kwargs(spec, case)
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    startup = time.perf_counter() - t0
    sc = llm.llm_engine.vllm_config.speculative_config
    result = {"name": case["name"], "method": getattr(sc, "method", None),
              "num_speculative_tokens": getattr(sc, "num_speculative_tokens", None),
              "additional_config": getattr(llm.llm_engine.vllm_config, "additional_config", None), "startup_s": startup}
    sp = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=spec.get("ignore_eos", False))
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    bs = case.get("batch_size") or spec.get("batch_size") or len(prompts)
    outputs, per_request, gen_s, n_tokens = [], [], 0.0, 0
    before = spec_decode_metrics(llm)
    for i in range(0, len(prompts), bs):
        t0 = time.perf_counter()
        res = llm.generate(prompts[i : i + bs], sp, use_tqdm=False)
        gen_s += time.perf_counter() - t0
        for r in res:
            c = r.outputs[0]
            outputs.append(list(c.token_ids))
            n_tokens += len(c.token_ids)
            m = getattr(c, "spec_decode_metrics", None)
            per_request.append(None if m is None else {"accepted": list(m.per_step_accepted),
                                                       "drafted": list(m.per_step_drafted)})
    result.update(outputs=outputs, spec=delta(spec_decode_metrics(llm), before), per_request=per_request,
                  generate_s=gen_s, tokens=n_tokens, plugin=plugin_state())
    if hasattr(llm.llm_engine, "engine_core"):  # V1; V0 frees its engine with the object
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return result


def config_checks(spec: dict) -> dict:
    """The plugin's routing decisions and errors, at engine-config time (no engine is started)."""
    from vllm.engine.arg_utils import EngineArgs

    import speculators.vllm_plugin.versions as plugin

    medusa, mlp = spec["config_checks"]["medusa"], spec["config_checks"]["mlp_speculator"]

    def engine_config(**kw):
        args = EngineArgs(model=spec["target"], dtype="float32", max_model_len=512, enforce_eager=True, **kw)
        return args.create_engine_config()

    def outcome(**kw):
        try:
            cfg = engine_config(**kw)
        except Exception as err:
            return {"error": f"{type(err).__name__}: {err}"}
        sc = cfg.speculative_config
        return {"method": getattr(sc, "method", None), "model": getattr(sc, "model", None),
                "k": getattr(sc, "num_speculative_tokens", None),
                "export": (cfg.additional_config or {}).get(plugin.EXPORT_KEY)}

    checks = {
        "mlp_auto": outcome(speculative_config={"model": mlp, "num_speculative_tokens": 2}),
        "mlp_default_k": outcome(speculative_config={"model": mlp}),
        "mlp_method_name": outcome(speculative_config={"method": "mlp_speculator", "model": mlp,
                                                       "num_speculative_tokens": 3}),
        "medusa_custom_class": outcome(speculative_config={"method": "custom_class", "model": medusa,
                                                           "num_speculative_tokens": 3}),
        "medusa_native": outcome(speculative_config={"method": "medusa", "model": medusa,
                                                     "num_speculative_tokens": 3}),
        "spec_model_alias": outcome(spec_model=mlp, spec_tokens=3),
        "too_many_tokens": outcome(speculative_config={"model": mlp, "num_speculative_tokens": 5}),
        "ngram": outcome(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                             "prompt_lookup_max": 4}),
        "none": outcome(),
    }
    # A Medusa directory that speculators did not write (no speculators_target key) stays vLLM's.
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:  # removed after use: each copy is ~110 MB
        foreign = Path(tmp) / "foreign-medusa"
        shutil.copytree(medusa, foreign)
        cfg = json.loads((foreign / "config.json").read_text())
        cfg.pop("speculators_target")
        (foreign / "config.json").write_text(json.dumps(cfg))
        checks["foreign_medusa"] = outcome(speculative_config={"model": str(foreign), "num_speculative_tokens": 3})
    # An unsupported vLLM version: one clear error when an export is involved, nothing otherwise.
    real = plugin.vllm_version
    plugin.vllm_version = lambda: "0.34.0"
    try:
        checks["version_mismatch_export"] = outcome(speculative_config={"model": mlp, "num_speculative_tokens": 3})
        checks["version_mismatch_plain"] = outcome()
        checks["version_mismatch_ngram"] = outcome(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                                       "prompt_lookup_max": 4})
    finally:
        plugin.vllm_version = real
    return checks


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    import vllm

    import speculators

    results = {"vllm_version": vllm.__version__, "speculators_path": speculators.__file__, "cases": []}

    def save():  # after every step, so a crash still leaves what ran
        with open(out_path, "w") as f:
            json.dump(results, f)

    exports_ready = False
    for case in spec["cases"]:
        if case.get("needs_exports") and not exports_ready:
            if spec.get("ready_file"):  # the exports are being trained while the first cases run
                from vllm_harness import wait_for  # this script's directory; imported late, it imports torch

                wait_for(Path(spec["ready_file"]))
            exports_ready = True
            if spec.get("config_checks"):
                results["config_checks"] = config_checks(spec)
                save()
                print("driver: config checks done", file=sys.stderr, flush=True)
        try:
            results["cases"].append(run_case(spec, case))
        except Exception as err:  # report it and go on: the test names the failing case
            import traceback

            traceback.print_exc()
            results["cases"].append({"name": case["name"], "error": f"{type(err).__name__}: {err}"})
        save()
        print(f"driver: {case['name']} done", file=sys.stderr, flush=True)
    if spec.get("config_checks") and "config_checks" not in results:
        results["config_checks"] = config_checks(spec)
        save()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
