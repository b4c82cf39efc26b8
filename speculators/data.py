"""Training and evaluation data through `datasets`.

Training sources: ShareGPT (the truncated offline copy, recovered conversation by
conversation), local json/jsonl/parquet/text files, or a Hub data set when online.
Conversations go through the target's chat template; the loss mask keeps the
assistant tokens. Tokenized sets are cached under the speculators cache.
Evaluation prompts (MT-Bench, HumanEval) are never used for training.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from pathlib import Path

import torch
from datasets import Dataset, load_dataset

from .assets import cache_dir, fetch

ROLE_NAMES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
              "bard": "assistant", "bing": "assistant", "system": "system"}
EVAL_SETS = ("mt-bench", "humaneval")


class DataError(ValueError):
    """Unusable data; the message says what is wrong and how to fix it."""


def iter_json_array(path: Path):
    """Yield the elements of a (possibly truncated) top-level JSON array one by one."""
    decoder = json.JSONDecoder()
    text = path.read_text(encoding="utf-8", errors="replace")
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail: everything before it was complete
        yield obj


def to_messages(record: dict) -> list[dict] | None:
    """Normalize ShareGPT-style ('conversations') or OpenAI-style ('messages') records."""
    turns = record.get("conversations") or record.get("messages")
    if not turns or not isinstance(turns, list):
        return None
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            continue
        role = ROLE_NAMES.get(turn.get("from") or turn.get("role"))
        content = turn.get("value") if "value" in turn else turn.get("content")
        if role is None or not isinstance(content, str) or not content.strip():
            continue
        messages.append({"role": role, "content": content})
    # Templates want alternating turns starting with the user (after an optional system prompt).
    body = [m for m in messages if m["role"] != "system"]
    if not body or body[0]["role"] != "user" or not any(m["role"] == "assistant" for m in body):
        return None
    for a, b in zip(body, body[1:]):
        if a["role"] == b["role"]:
            return None
    return messages


def check_source(source: str) -> None:
    """Fail fast, before any model loads, on a data source that cannot exist."""
    if source in EVAL_SETS:
        raise DataError(f"{source} is an evaluation set; training on it would inflate every reported number")
    if source == "sharegpt" or Path(source).expanduser().exists():
        return
    if source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise DataError(f"data set not found: {source} (give 'sharegpt', a local file or a Hub data set name)")
    if os.environ.get("HF_HUB_OFFLINE", "1") not in ("0", "false", "False"):
        raise DataError(f"data set {source!r} is not a local file and the Hub is offline (set HF_HUB_OFFLINE=0)")


def load_records(source: str) -> tuple[list[dict], str]:
    """(records, kind) where kind is 'chat' (records with messages) or 'text'."""
    if source == "sharegpt":
        path = fetch("sharegpt")
        return [{"messages": m} for r in iter_json_array(path) if (m := to_messages(r))], "chat"
    path = Path(source).expanduser()
    if path.exists():
        if path.is_dir():
            raise DataError(f"{path} is a directory; give a .json, .jsonl, .parquet or .txt file")
        suffix = "".join(path.suffixes[-2:]) if path.suffix == ".gz" else path.suffix
        try:
            if suffix == ".json":
                rows = _json_rows(path)
            elif suffix in (".jsonl", ".jsonl.gz"):
                rows = _jsonl_rows(path, gzip.open if suffix.endswith(".gz") else open)
            elif suffix == ".parquet":
                rows = load_dataset("parquet", data_files=str(path), split="train").to_list()
            elif suffix == ".txt":
                return [{"text": t} for t in path.read_text(encoding="utf-8").split("\n\n") if t.strip()], "text"
            else:
                raise DataError(f"{path}: unsupported data file type {suffix!r} (use .json, .jsonl, .parquet or .txt)")
        except UnicodeDecodeError as err:
            raise DataError(f"{path}: not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}); "
                            f"give a text file") from None
        except (OSError, EOFError) as err:  # a damaged .gz, an unreadable file
            raise DataError(f"{path}: cannot be read ({err})") from None
    else:
        check_source(source)
        rows = load_dataset(source, split="train").to_list()
    chats = [{"messages": m} for r in rows if (m := to_messages(r))]
    if chats:
        return chats, "chat"
    texts = [{"text": r["text"]} for r in rows if isinstance(r.get("text"), str) and r["text"].strip()]
    return texts, "text"


def _json_rows(path: Path) -> list:
    """The records of a .json file: a top-level array (a truncated one keeps its complete elements, as
    the offline ShareGPT copy needs) or an object with a "data" array."""
    text = path.read_text(encoding="utf-8")
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        if not text.lstrip().startswith("["):
            raise DataError(f"{path}:{err.lineno}: not valid JSON ({err.msg} at column {err.colno})") from None
        raw = list(iter_json_array(path))
    rows = raw if isinstance(raw, list) else raw.get("data", []) if isinstance(raw, dict) else None
    if not isinstance(rows, list):
        raise DataError(f"{path}: expected a JSON array of records or an object with a \"data\" array")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{path}: record {i} is a {type(row).__name__}, not a JSON object")
    return rows


def _jsonl_rows(path: Path, opener) -> list[dict]:
    """The records of a .jsonl file, one JSON object a line; a bad line is named by its number."""
    rows = []
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{lineno}: not valid JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: a {type(row).__name__}, not a JSON object")
            rows.append(row)
    return rows


def _tokenize_chats(batch, tokenizer, max_len):
    input_ids, loss_mask = [], []
    for messages in batch["messages"]:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
            end = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
            if text.startswith(start) and text.startswith(end):
                spans.append((len(start), len(end)))
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, truncation=True,
                        max_length=max_len)
        # Templates whose prefixes are not string prefixes of the whole conversation get no
        # assistant spans; their loss covers every token rather than none.
        mask = [int(not spans or any(a <= s < b for a, b in spans)) for s, _ in enc["offset_mapping"]]
        input_ids.append(enc["input_ids"])
        loss_mask.append(mask)
    return {"input_ids": input_ids, "loss_mask": loss_mask}


def _tokenize_texts(batch, tokenizer, max_len):
    enc = tokenizer(batch["text"], truncation=True, max_length=max_len)
    return {"input_ids": enc["input_ids"], "loss_mask": [[1] * len(ids) for ids in enc["input_ids"]]}


def build_dataset(source: str, tokenizer, max_len: int, max_samples: int | None = None, seed: int = 0,
                  min_tokens: int = 16) -> Dataset:
    """Tokenized training set with columns input_ids and loss_mask, cached on disk."""
    check_source(source)
    key = hashlib.sha256(
        json.dumps([source, str(Path(source).stat().st_mtime) if Path(source).exists() else "", tokenizer.name_or_path,
                    len(tokenizer), tokenizer.chat_template or "", max_len, max_samples, seed, min_tokens]).encode()
    ).hexdigest()[:16]
    cached = cache_dir() / "datasets" / key
    if cached.exists():
        return Dataset.load_from_disk(str(cached))
    records, kind = load_records(source)
    if not records:
        raise DataError(f"data set {source!r} has no usable conversations or text")
    ds = Dataset.from_list(records).shuffle(seed=seed)
    if max_samples:
        ds = ds.select(range(min(max_samples, len(ds))))
    fn = _tokenize_chats if kind == "chat" else _tokenize_texts
    ds = ds.map(fn, batched=True, batch_size=256, remove_columns=ds.column_names,
                fn_kwargs={"tokenizer": tokenizer, "max_len": max_len}, desc=f"tokenizing {source}")
    ds = ds.filter(lambda r: len(r["input_ids"]) >= min_tokens and sum(r["loss_mask"]) > 0)
    if len(ds) == 0:
        raise DataError(f"data set {source!r} is empty after tokenization (every sample shorter than {min_tokens} tokens)")
    ds.save_to_disk(str(cached))
    return Dataset.load_from_disk(str(cached))


def prompts_from(source: str, n: int | None = None, seed: int = 0) -> list[list[dict]]:
    """First user turns of a chat data set, as message lists (prompts for target/draft generation)."""
    records, kind = load_records(source)
    if kind != "chat":
        raise DataError(f"{source} has no conversations to take prompts from")
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(records), generator=g).tolist()
    prompts = []
    for i in order:
        msgs = records[i]["messages"]
        first_user = next(j for j, m in enumerate(msgs) if m["role"] == "user")
        prompts.append(msgs[: first_user + 1])
        if n and len(prompts) >= n:
            break
    return prompts


def eval_prompts(name: str, n: int | None = None) -> list[list[dict]]:
    """Evaluation prompts as chat messages: MT-Bench first turns or HumanEval problems."""
    if name == "mt-bench":
        with open(fetch("mt-bench")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        prompts = [[{"role": "user", "content": r["turns"][0]}] for r in rows]
    elif name == "humaneval":
        with gzip.open(fetch("humaneval"), "rt") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        prompts = [[{"role": "user", "content": "Complete this Python function.\n\n" + r["prompt"]}] for r in rows]
    elif Path(name).suffix in (".jsonl", ".json", ".txt"):
        prompts = [[{"role": "user", "content": text}] for text in _user_prompts(Path(name))]
    else:
        raise DataError(f"unknown evaluation set {name!r}: choose from {list(EVAL_SETS)} or give a .jsonl, .json "
                        f"or .txt file of prompts")
    return prompts[:n] if n else prompts


def _user_prompts(path: Path) -> list[str]:
    """Your own prompts, one user message each: a .txt line, or a .jsonl / .json record (an object) with
    "prompt", "content", "text" or "turns" (the first turn)."""
    if not path.is_file():
        raise DataError(f"{path}: no such prompt file")
    try:
        if path.suffix == ".txt":
            return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()] or \
                _no_prompts(path)
        rows = _jsonl_rows(path, open) if path.suffix == ".jsonl" else _json_rows(path)
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text; give one prompt per line (.txt) or per record (.jsonl/.json)") from None
    prompts = []
    for i, r in enumerate(rows):
        text = next((r[k] for k in ("prompt", "content", "text") if isinstance(r.get(k), str)), None)
        if text is None and isinstance(r.get("turns"), list) and r["turns"]:
            text = r["turns"][0]
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"{path}: record {i + 1} has no prompt text; give an object with \"prompt\"")
        prompts.append(text)
    return prompts or _no_prompts(path)


def _no_prompts(path: Path):
    raise DataError(f"{path}: holds no prompts")


def collate(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a list of tokenized rows into input_ids, attention_mask and loss_mask (and "hidden",
    the target's cached hidden states, where the rows carry them: see stage_data.cache_target_hidden)."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.tensor(r["input_ids"])
        attn[i, :n] = 1
        mask[i, :n] = torch.tensor(r["loss_mask"])
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": mask}
    if "hidden" in rows[0]:
        batch["hidden"] = torch.nn.utils.rnn.pad_sequence([r["hidden"] for r in rows], batch_first=True)
    return batch


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat prompt ready for the assistant's answer."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]

