"""The `custom_class` proposer vLLM builds for a `speculators` export, and the runner hook that feeds it.

vLLM's custom_class interface (0.32 and 0.33, `vllm/v1/spec_decode/custom_class_proposer.py` and
`GPUModelRunner.propose_draft_token_ids`):

    proposer = Class(vllm_config)           # in the model runner's __init__, on the last PP rank
    proposer.load_model(target_model)       # after the target loads (mandatory on CPU)
    proposer.propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None)
        -> list[list[int]]                  # one draft list per request, [] for none

`propose` receives no hidden states, so the first proposer built in a process wraps
`GPUModelRunner.propose_draft_token_ids` (which `CPUModelRunner` inherits): when the runner's drafter
is one of ours, the wrapper hands it the runner's `sample_hidden_states` and `spec_decode_metadata`
just before the runner calls `propose`. Runners with any other drafter pass straight through.

The heads are our own `MLPSpeculator` / `Medusa` (`.propose(hidden, tokens, k)`), so vLLM and
`speculators eval` run one implementation of the math. Drafts are a greedy top-1 chain.

With the hybrid on (the export's `speculators_hybrid.enabled`, or
`additional_config={"speculators": {"hybrid": bool}}`), `speculators.proposers.Hybrid` keeps a suffix
lookup per request (keyed by vLLM's request id, the prompt read from the input batch) and over recent
requests' outputs, and per request and step sends the lookup's draft or the heads', by the same rule
as `speculators eval --hybrid`. Requests that left the batch are finished first, so their output is
in the lookup's cache when the next request drafts, as in the engine.
No attribute is called `model`: vLLM's runner treats `drafter.model` as a draft network.
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch

from .versions import EXPORT_KEY, check_vllm_version

logger = logging.getLogger("vllm.speculators")


class SpeculatorsProposer:
    """Drafts k tokens per request from the target's last accepted hidden state."""

    def __init__(self, vllm_config):
        check_vllm_version()
        export = (vllm_config.additional_config or {}).get(EXPORT_KEY) if isinstance(
            vllm_config.additional_config, dict) else None
        if not export or "export_dir" not in export:
            raise ValueError(
                f"{__name__}.SpeculatorsProposer needs additional_config['{EXPORT_KEY}']['export_dir']; pass "
                f"speculative_config={{'model': EXPORT_DIR, 'num_speculative_tokens': k}} and the speculators "
                f"plugin fills it in"
            )
        self.export_dir = export["export_dir"]
        self.kind = export.get("kind")
        self.use_hybrid = bool(export.get("hybrid", False))
        self.hybrid = None  # speculators.proposers.Hybrid; filled by load_model when use_hybrid
        self.max_model_len = vllm_config.model_config.max_model_len
        self.num_speculative_tokens = vllm_config.speculative_config.num_speculative_tokens
        self.dtype = vllm_config.model_config.dtype
        self.target_sizes = _target_sizes(vllm_config.model_config)  # (vocab, hidden) or None
        self.heads = None  # the speculator; filled by load_model
        self._hidden = None  # the runner's sample_hidden_states for the current step
        self._spec_meta = None  # the runner's spec_decode_metadata for the current step
        self._batch = None  # the runner's input_batch: request ids and prompts, for the hybrid
        install_runner_hook()

    def load_model(self, target_model=None, *args, **kwargs) -> None:
        import json
        from pathlib import Path

        from ..models import MODEL_TYPES
        from ..models.base import CheckpointError

        kind = json.loads((Path(self.export_dir) / "config.json").read_text()).get("model_type")
        if kind not in MODEL_TYPES:
            raise CheckpointError(f"{self.export_dir}: model_type {kind!r} is not one of {sorted(MODEL_TYPES)}")
        heads = MODEL_TYPES[kind].from_pretrained(self.export_dir)
        c = heads.config
        sizes = (c.vocab_size, c.emb_dim if kind == "mlp_speculator" else c.hidden_size)
        if self.target_sizes is not None and sizes != self.target_sizes:
            raise CheckpointError(f"{self.export_dir} has (vocab, hidden) = {sizes}, the target {self.target_sizes}; "
                                  f"train the speculator for this target")
        device = torch.device("cpu")
        if target_model is not None:
            param = next(iter(target_model.parameters()), None)
            if param is not None:
                device = param.device
        self.heads = heads.to(device=device, dtype=self.dtype).eval().requires_grad_(False)
        self.kind = kind
        if self.use_hybrid:
            from ..proposers import Hybrid

            self.hybrid = Hybrid(heads.hybrid_config())
        logger.info("speculators: loaded %s heads from %s (k=%d, %s, %s%s)", kind, self.export_dir,
                    self.num_speculative_tokens, self.dtype, device, ", hybrid" if self.hybrid else "")

    def set_runner_inputs(self, sample_hidden_states, spec_decode_metadata, input_batch) -> None:
        self._hidden, self._spec_meta, self._batch = sample_hidden_states, spec_decode_metadata, input_batch

    @torch.inference_mode()
    def propose(self, sampled_token_ids, num_tokens_no_spec=None, token_ids_cpu=None, slot_mappings=None,
                **kwargs) -> list[list[int]]:
        hidden, meta, batch = self._hidden, self._spec_meta, self._batch
        self._hidden = self._spec_meta = self._batch = None
        if hidden is None:
            raise RuntimeError(
                "speculators: the model runner did not hand over its hidden states; the runner hook on "
                "GPUModelRunner.propose_draft_token_ids is not active (is this vLLM's V1 model runner?)"
            )
        n = len(sampled_token_ids)
        # The row holding each request's last accepted token (vLLM's own Medusa rule): one row per
        # request when no drafts were verified this step, else num_draft + 1 rows per request.
        if hidden.shape[0] == n:
            rows = list(range(n))
        else:
            if meta is None:
                raise RuntimeError("speculators: hidden states carry draft rows but no spec_decode_metadata")
            rows, offset = [], 0
            for num_draft, tokens in zip(meta.num_draft_tokens, sampled_token_ids):
                rows.append(offset + len(tokens) - 1)
                offset += num_draft + 1
        live = [i for i, tokens in enumerate(sampled_token_ids) if tokens]
        drafts: list[list[int]] = [[] for _ in range(n)]
        if not live:
            return drafts
        index = torch.tensor([rows[i] for i in live], device=hidden.device)
        last = torch.tensor([sampled_token_ids[i][-1] for i in live], device=hidden.device)
        out = self.heads.propose(hidden.index_select(0, index).to(self.dtype), last, self.num_speculative_tokens)
        for i, row in zip(live, out.tolist()):
            drafts[i] = row
        if self.hybrid is not None:
            self._choose(drafts, sampled_token_ids, live, batch, token_ids_cpu)
        return drafts

    def _choose(self, drafts, sampled_token_ids, live, batch, token_ids_cpu) -> None:
        """Per live request, replace the heads' draft by the suffix lookup's where `Hybrid.choose` says so."""
        hybrid = self.hybrid
        req_ids = batch.req_ids
        for req_id in list(hybrid.active - set(req_ids)):
            hybrid.finish(req_id)  # left the batch: finished or preempted (a preempted one starts over)
        # vLLM verifies greedy and sampled requests alike; sampled ones have a positive temperature
        greedy = getattr(batch, "greedy_reqs", None)
        for i in live:
            req_id = req_ids[i]
            new, n_tokens = list(sampled_token_ids[i]), int(batch.num_tokens_no_spec[i])  # n_tokens counts `new`
            if req_id not in hybrid.active:  # its prompt; for a preempted request, what it had generated too
                hybrid.start(req_id, token_ids_cpu[i, : n_tokens - len(new)].tolist())
            hybrid.extend(req_id, new)
            k = min(self.num_speculative_tokens, self.max_model_len - n_tokens - 1)
            lookup = hybrid.lookup_draft(req_id, k)
            learn = greedy is None or req_id in greedy
            if hybrid.choose(req_id, lookup, drafts[i], learn=learn) == "lookup":
                drafts[i] = lookup[0]


def _target_sizes(model_config) -> tuple[int, int] | None:
    try:
        return model_config.get_vocab_size(), model_config.get_hidden_size()
    except Exception:
        return None


def install_runner_hook() -> None:
    """Wrap GPUModelRunner.propose_draft_token_ids once per process (see the module docstring)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    orig = GPUModelRunner.propose_draft_token_ids
    if getattr(orig, "_speculators_hook", False):
        return
    params = list(inspect.signature(orig).parameters)
    missing = [p for p in ("sample_hidden_states", "spec_decode_metadata") if p not in params]
    if missing:
        raise RuntimeError(
            f"speculators: GPUModelRunner.propose_draft_token_ids has no {missing} parameter in this vLLM; "
            f"the plugin supports vLLM 0.32-0.33"
        )
    i_hidden = params.index("sample_hidden_states")  # positions count `self`
    i_meta = params.index("spec_decode_metadata")

    def pick(args, kwargs, i, name):
        return args[i] if len(args) > i else kwargs.get(name)

    @functools.wraps(orig)
    def propose_draft_token_ids(*args, **kwargs):
        runner = args[0]
        drafter = getattr(runner, "drafter", None)
        if isinstance(drafter, SpeculatorsProposer):
            drafter.set_runner_inputs(pick(args, kwargs, i_hidden, "sample_hidden_states"),
                                      pick(args, kwargs, i_meta, "spec_decode_metadata"), runner.input_batch)
        return orig(*args, **kwargs)

    propose_draft_token_ids._speculators_hook = True
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
