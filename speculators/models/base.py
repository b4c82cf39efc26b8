"""What every proposer shares: a JSON config and safetensors save/load with strict checks.

`save_pretrained` writes the exact tensor names vLLM loads (each model maps its
parameters to those names explicitly), so a training checkpoint is already in
vLLM's layout; `speculators export` validates it against the target and adds
the model card.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
# The draft vocabulary's token ids, int64 [N] ascending, beside the weights in WEIGHTS_NAME. vLLM's
# mlp_speculator and medusa loaders (every version) look each checkpoint tensor up among their parameters
# and skip names they lack, so the extra tensor leaves their loading unchanged; it is not named
# "token_map", the one extra name vLLM's Medusa loader reads.
DRAFT_VOCAB_TENSOR = "draft_vocab_ids"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says what is wrong and how to fix it."""


def input_major(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """The same [..., out, in] weights stored input-major ([..., in, out] contiguous, viewed
    transposed), for the CPU proposals of both kinds. A batch-1 step there is a GEMV per weight, and
    MKL reads an input-major matrix 1.7-2x faster: 2.3 ms against 3.9-4.7 ms for a [16384 x 576]
    fp32 head on a 2-core EPYC (benchmarks/bench_cpu_gemm.py). The Triton kernels (CUDA) keep the
    row-major weights. Weights shared between stages share one copy."""
    copies = {}
    for t in weights:
        if t.data_ptr() not in copies:
            copies[t.data_ptr()] = t.detach().mT.contiguous().mT
    return [copies[t.data_ptr()] for t in weights]


def config_from_dict(cls, data: dict, source: str):
    """Build a config dataclass, refusing keys it does not know."""
    fields = {f.name for f in dataclasses.fields(cls)}
    data = {k: v for k, v in data.items() if k not in cls.IGNORED_KEYS}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise CheckpointError(f"{source}: unknown config key(s) {unknown}; known keys are {sorted(fields)}")
    return cls(**data)


def read_safetensors(path: Path, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """Load a weight file; pickles are refused unless the caller opts in."""
    path = Path(path)
    if path.suffix in (".bin", ".pt", ".pth", ".ckpt"):
        if not allow_pickle:
            raise CheckpointError(
                f"{path} is a pickle checkpoint, which can run arbitrary code when loaded; "
                f"convert it to safetensors or pass --allow-pickle if you trust it"
            )
        tensors = torch.load(path, map_location="cpu", weights_only=False)
        if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            raise CheckpointError(f"{path} does not hold a dict of tensors (a state dict); save the weights alone")
    else:
        try:
            tensors = load_file(str(path))
        except (SafetensorError, OSError, ValueError) as err:
            raise CheckpointError(f"{path} is not a readable safetensors file ({err}); it may be truncated or "
                                  f"corrupt") from None
    # A damaged header can name another dtype of the same size (int32 for float32): the file then loads
    # without complaint and the bits, read as integers, become weights of 1e9. Weights are floating point.
    floats = [t.dtype for t in tensors.values() if t.is_floating_point()]
    for name, t in tensors.items():
        if not t.is_floating_point() and not (name == DRAFT_VOCAB_TENSOR and t.dtype == torch.int64):
            expected = str(max(set(floats), key=floats.count)).removeprefix("torch.") if floats else "floating point"
            raise CheckpointError(f"{path}: tensor {name} has dtype {str(t.dtype).removeprefix('torch.')} where "
                                  f"{expected} is expected; the file's header may be damaged: export or save it again")
    return tensors


# atomic_write_dir and atomic_write_file write through siblings named ".NAME.tmp-PID" (the new
# version, being written) and ".NAME.old-PID" (the version being replaced, between the two renames).
# Only names of this form are ever cleaned up, so nothing else beside NAME is touched.
_LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old)-\d+")


def fault_point(stage: str) -> None:
    """Test hook: SPECULATORS_FAULT_AT=<stage> ends the process here as kill -9 would (exit code 137),
    so the tests interrupt a write at each of its steps without relying on timing. A stage is
    "<point>:<name>", <name> being the file or directory written and <point> one of dir_written,
    old_moved, dir_renamed (atomic_write_dir), file_written (atomic_write_file), latest_updated and
    history_appended (checkpoint.RunDirectory; their name is the step's checkpoint, step-0000002)."""
    if os.environ.get("SPECULATORS_FAULT_AT") == stage:
        os._exit(137)


def _leftovers(parent: Path, name: str | None = None):
    """(path, match) of each interrupted write's leftover in `parent` (only those to `name`, when given)."""
    parent = Path(parent)
    if not parent.is_dir():
        return
    for entry in sorted(os.listdir(parent)):
        match = _LEFTOVER.fullmatch(entry)
        if match and name in (None, match["name"]):
            yield parent / entry, match


def unfinished_writes(path: Path) -> list[Path]:
    """What interrupted atomic writes to `path` left beside it, which the next write to it resolves."""
    return [leftover for leftover, _ in _leftovers(Path(path).parent, Path(path).name)]


def recover_writes(parent: Path, name: str | None = None) -> None:
    """Finish what interrupted atomic writes left in `parent` (only those to `name`, when given). A
    replacement killed between its two renames gets its previous version back (the only complete one);
    every other leftover is a temporary copy or an already replaced version, and is deleted."""
    for leftover, match in list(_leftovers(parent, name)):
        final = leftover.parent / match["name"]
        if match["kind"] == "old" and not final.exists():
            leftover.rename(final)
        else:
            _remove(leftover)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def atomic_write_dir(out_dir: Path, write) -> None:
    """Run write(tmp_dir), then put tmp_dir in place of out_dir (a directory of any depth, or none), so
    out_dir always holds a complete version, the old or the new one. A write that raises leaves out_dir
    as it was and no temporary copy. A process killed part way leaves ".NAME.tmp-PID" or ".NAME.old-PID"
    beside it, which recover_writes resolves: here, before the next write to out_dir, and when the
    trainer resumes a run."""
    out_dir = Path(out_dir)
    recover_writes(out_dir.parent, out_dir.name)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        # safetensors writes through a private temporary file (mode 0600); give every file the
        # umask's usual mode so a server running as another user (vLLM in a container) can read it.
        umask = os.umask(0)
        os.umask(umask)
        for f in tmp.rglob("*"):
            if f.is_file():
                f.chmod(0o666 & ~umask)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fault_point(f"dir_written:{out_dir.name}")
    if out_dir.exists() or out_dir.is_symlink():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        out_dir.rename(old)
        fault_point(f"old_moved:{out_dir.name}")
        tmp.rename(out_dir)
        fault_point(f"dir_renamed:{out_dir.name}")
        _remove(old)
    else:
        tmp.rename(out_dir)
        fault_point(f"dir_renamed:{out_dir.name}")


def atomic_write_file(path: Path, text: str) -> None:
    """Replace the file `path` by one holding `text` in a single step (a temporary sibling, then
    os.replace), so a reader or a kill never finds it half written."""
    path = Path(path)
    recover_writes(path.parent, path.name)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    fault_point(f"file_written:{path.name}")
    os.replace(tmp, path)


def default_hybrid_settings() -> dict:
    """Every setting of the suffix-lookup hybrid at its default, as a speculator's config.json records them."""
    from dataclasses import asdict

    from speculators.proposers import HybridConfig

    return asdict(HybridConfig())


class SpeculatorModel(nn.Module):
    """Base for proposers that read the target's post-final-norm hidden states."""

    config_class = None  # a dataclass with MODEL_TYPE, IGNORED_KEYS and to_json()

    def __init__(self):
        super().__init__()
        # draft_vocab(), set by keep_vocab_ or a load: a buffer, so .to() moves it with the heads, kept out
        # of state_dict() since save_pretrained writes it under its own name (DRAFT_VOCAB_TENSOR)
        self.register_buffer("draft_vocab_ids", None, persistent=False)

    def vllm_state_dict(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def hybrid_config(self):
        """The suffix-lookup hybrid's settings recorded with this speculator (`speculators_hybrid` in its
        config.json), so eval, generate and the vLLM plugin apply the same rule."""
        from speculators.proposers import HybridConfig

        return config_from_dict(HybridConfig, self.config.speculators_hybrid, "config.json speculators_hybrid")

    def vocab_heads(self) -> torch.Tensor:
        """The lm-head parameter, [heads, vocab, width]: row v of every head scores token v."""
        raise NotImplementedError

    def widest_topk(self) -> int:
        """The most candidates a proposal takes from one head (1 for a chain)."""
        raise NotImplementedError

    @torch.no_grad()
    def keep_vocab_(self, keep: torch.Tensor) -> None:
        """Restrict every head to the token ids `keep` (a draft vocabulary, as FR-Spec): they become
        draft_vocab(), saved with the weights, and every other row is set to zero. The loss reads only
        the kept rows, so a zero row gets no gradient and no optimizer update and stays zero; vLLM loads
        such heads unchanged and computes the same proposals from all rows."""
        heads = self.vocab_heads()
        ids = torch.unique(keep.to(device=heads.device, dtype=torch.int64))  # ascending, each once
        heads[:, self._rows_outside(ids)] = 0
        self.draft_vocab_ids = ids
        self.config.speculators_draft_vocab_size = len(ids)

    def _rows_outside(self, ids: torch.Tensor) -> torch.Tensor:
        """Mask [vocab] of the head rows not in `ids`."""
        others = torch.ones(self.vocab_heads().shape[-2], dtype=torch.bool, device=ids.device)
        others[ids] = False
        return others

    def draft_vocab(self) -> torch.Tensor | None:
        """Ascending ids [N] of the tokens this speculator can propose, when training kept it to a draft
        vocabulary (`draft_vocab` in a recipe, see keep_vocab_), else None."""
        return self.draft_vocab_ids

    def proposal_vocab(self) -> torch.Tensor | None:
        """The head rows proposing reads: the draft vocabulary plus its lowest-id zero rows, as many as
        the widest top-k. A zero row's logit is exactly 0 (vLLM computes it so too), and when every
        draft-vocabulary logit of a row is negative it wins; keeping the lowest-id ones makes argmax
        and top-k, ties included, equal to reading every row — at N/V of the bytes."""
        draft = self.draft_vocab()
        if draft is None:
            return None
        zero_rows = self._rows_outside(draft).nonzero().squeeze(1)
        return torch.cat([draft, zero_rows[: self.widest_topk()]]).sort().values

    def _load_draft_vocab(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take the draft vocabulary from loaded tensors (DRAFT_VOCAB_TENSOR), after load_weights copied
        the heads, checking it against the config and the heads' zero rows."""
        ids, declared = tensors.get(DRAFT_VOCAB_TENSOR), self.config.speculators_draft_vocab_size
        heads = self.vocab_heads().detach()
        if ids is None:
            if declared:
                raise CheckpointError(f"config.json declares speculators_draft_vocab_size {declared} but the "
                                      f"weights lack the {DRAFT_VOCAB_TENSOR} tensor; save or export the "
                                      f"checkpoint again")
            # Checkpoints saved before the ids were stored mark the draft vocabulary only by all-zero head
            # rows: it is read from them here, once, and stored like an explicit one.
            live = heads.ne(0).any(-1).any(0)
            self.draft_vocab_ids = None if bool(live.all()) else live.nonzero().squeeze(1)
            if self.draft_vocab_ids is not None:
                self.config.speculators_draft_vocab_size = len(self.draft_vocab_ids)
            return
        vocab = heads.shape[-2]
        if ids.dim() != 1 or not len(ids) or (declared and len(ids) != declared):
            raise CheckpointError(f"tensor {DRAFT_VOCAB_TENSOR} has shape {tuple(ids.shape)} where config.json's "
                                  f"speculators_draft_vocab_size implies ({declared or 'N >= 1'},); save or export "
                                  f"the checkpoint again")
        if bool((ids[1:] <= ids[:-1]).any()) or int(ids[0]) < 0 or int(ids[-1]) >= vocab:
            raise CheckpointError(f"tensor {DRAFT_VOCAB_TENSOR} is not ascending distinct token ids below the "
                                  f"vocabulary size {vocab}; save or export the checkpoint again")
        ids = ids.to(heads.device)
        if bool(heads[:, self._rows_outside(ids)].ne(0).any()):
            raise CheckpointError(f"head rows outside {DRAFT_VOCAB_TENSOR} are not zero, so vLLM would propose "
                                  f"tokens outside the draft vocabulary; save or export the checkpoint again")
        self.draft_vocab_ids = ids
        self.config.speculators_draft_vocab_size = len(ids)

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def save_pretrained(self, out_dir: str | Path) -> None:
        def write(tmp: Path):
            tensors = {k: v.detach().contiguous().cpu() for k, v in self.vllm_state_dict().items()}
            if self.draft_vocab_ids is not None:
                tensors[DRAFT_VOCAB_TENSOR] = self.draft_vocab_ids.cpu()
            save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
            (tmp / CONFIG_NAME).write_text(json.dumps(self.config.to_json(), indent=2) + "\n")

        atomic_write_dir(Path(out_dir), write)

    @classmethod
    def from_pretrained(cls, path: str | Path, allow_pickle: bool = False):
        path = Path(path)
        config_file = path / CONFIG_NAME
        if not config_file.exists():
            raise CheckpointError(f"{path} has no {CONFIG_NAME}; give a directory written by speculators")
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{config_file} is not valid JSON ({err})") from None
        config = config_from_dict(cls.config_class, raw, str(config_file))
        weights = path / WEIGHTS_NAME
        if not weights.exists():
            pickles = [p for p in (path / "pytorch_model.bin", path / "model.pt") if p.exists()]
            if not pickles:
                raise CheckpointError(f"{path} has no {WEIGHTS_NAME}")
            weights = pickles[0]
        model = cls(config)
        model.load_weights(read_safetensors(weights, allow_pickle))
        return model

    def _check_and_copy(self, tensors: dict[str, torch.Tensor], expected: dict[str, nn.Parameter | torch.Tensor]):
        missing = sorted(set(expected) - set(tensors))
        if missing:
            raise CheckpointError(f"checkpoint lacks tensors {missing[:4]}{'...' if len(missing) > 4 else ''}")
        # One floating dtype for all weights (what save_pretrained and export write): a tensor of another
        # dtype, float or not, is a damaged header, whose bits copy_ would convert into garbage values.
        dtypes = [tensors[name].dtype for name in expected]
        common = max(set(dtypes), key=dtypes.count)
        if not common.is_floating_point:
            common = next(iter(expected.values())).dtype
        with torch.no_grad():
            for name, dst in expected.items():
                src = tensors[name]
                if src.dtype != common:
                    raise CheckpointError(f"tensor {name} has dtype {str(src.dtype).removeprefix('torch.')} where "
                                          f"{str(common).removeprefix('torch.')} is expected (the dtype of the "
                                          f"checkpoint's weights); its header may be damaged: export or save it again")
                if tuple(src.shape) != tuple(dst.shape):
                    raise CheckpointError(
                        f"tensor {name} has shape {tuple(src.shape)} but the config implies {tuple(dst.shape)}"
                    )
                dst.copy_(src)
