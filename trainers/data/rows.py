"""Reading, normalizing, validating and tokenizing prompt/completion, preference and evaluation data.

Rows are either *standard* (strings) or *conversational* (lists of ``{"role", "content"}``
messages). Accepted shapes, after a source's ``columns`` mapping renames its columns:

* SFT: ``prompt``/``completion``, or ``messages`` (the prompt is every message before the last
  assistant turn, the completion is that turn and anything after it);
* preference: ``prompt``/``chosen``/``rejected``, or conversational ``chosen``/``rejected`` only
  (*implicit prompt*: their longest common message prefix is the prompt).

A conversational prompt is rendered with the chat template and the generation prompt. A
conversational completion is rendered by the template as the continuation of its prompt: the
whole conversation is rendered once and the completion is what follows the prompt's render (so
it ends with the template's end-of-turn marker). A string completion is its text followed by EOS.
"""

from __future__ import annotations

import csv
import json
import math
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Literal, TypeGuard

from trainers.models.stop_tokens import rendered_text, stop_token_ids

# The splits whose rows reach reward functions keep each row as read, JSON (its prompt as written,
# strings or messages, and every other column), in this column of the prepared data.
REWARD_SPLITS = ("grpo_prompts",)
SOURCE_ROW = "source_row"

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from trainers.data.clipping import TextClip

SPLIT_FIELDS: dict[str, tuple[str, ...]] = {
    "sft": ("prompt", "completion"),
    "sft_eval": ("prompt", "completion"),  # held-out demonstrations: SFT's eval loss
    "preference": ("prompt", "chosen", "rejected"),
    "preference_eval": ("prompt", "chosen", "rejected"),
    "eval_prompts": ("prompt", "answer"),
    "grpo_prompts": ("prompt",),  # an `answer` column, when present, reaches the reward functions
    "unpaired": ("prompt", "completion"),  # and `label` (LABEL): KTO's labelled completions
}
COMPLETION_FIELDS = {"completion", "chosen", "rejected"}
PAIR_SPLITS = ("preference", "preference_eval")
# An optional column of preference pairs: how much better the chosen answer is (Llama 2's margin in
# the reward model's Bradley–Terry loss, trainers.scoring.reward_model); kept through preparation as a float.
MARGIN = "margin"
# The unpaired split's label (TRL's unpaired format): true for a desirable completion; kept as a bool.
LABEL = "label"
# The reference's cached log-probs, joined onto the preference splits as these columns.
REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
LOCAL_BUILDERS = {".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
JSON_SUFFIXES = {".json", ".jsonl"}
SAVED_DATASET_FILES = ("dataset_info.json", "state.json", "dataset_dict.json")


class DataValidationError(ValueError):
    """A row of an input dataset is unusable; the message names the source, row and field."""


@dataclass(frozen=True)
class Truncation:
    """``max_prompt_length`` cuts the prompt (``keep_end``: keep its last tokens, ``keep_start``:
    its first); the completion is then cut to fit ``max_length``, keeping its start. ``drop``
    cuts nothing: a row that does not fit (prompt or prompt + completion) is dropped."""

    max_length: int
    max_prompt_length: int
    mode: Literal["keep_end", "keep_start", "drop"] = "keep_end"


# --- reading -------------------------------------------------------------------------------------


def load_rows(
    path: str,
    name: str | None = None,
    split: str = "train",
    revision: str | None = None,
    columns: dict[str, str] | None = None,
) -> list[dict]:
    """Rows of a local .json/.jsonl/.parquet/.csv/.arrow file, of a ``save_to_disk`` folder or of
    any ``datasets.load_dataset`` source; ``columns`` (field -> column) renames columns to fields.
    A file that cannot be read, or that holds no rows, raises :class:`DataValidationError` naming it."""
    import datasets  # here: the config reads this module's split names without it (KTO's reference view)

    local = Path(path)
    suffix = local.suffix.lower()
    if (suffix in JSON_SUFFIXES or suffix in LOCAL_BUILDERS) and not local.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")
    if suffix in JSON_SUFFIXES:
        # Read JSON ourselves: Arrow would coerce mixed types per column and hide bad rows.
        rows = read_json_rows(local)
    elif local.is_file() and suffix in LOCAL_BUILDERS:
        rows = _read_local_file(local, suffix)
    elif local.is_dir() and any((local / f).is_file() for f in SAVED_DATASET_FILES):
        saved = datasets.load_from_disk(str(local))
        if isinstance(saved, datasets.DatasetDict):
            if split not in saved:
                raise DataValidationError(f"{path}: no split {split!r} (has {sorted(saved)})")
            saved = saved[split]
        rows = saved.to_list()
    else:
        rows = datasets.load_dataset(path, name, split=split, revision=revision).to_list()
    if not rows:
        raise DataValidationError(f"{path}: the dataset has no rows")
    return rename_columns(rows, columns or {}, path)


def _read_local_file(path: Path, suffix: str) -> list[dict]:
    import datasets

    options: dict[str, Any] = {}
    try:
        if suffix == ".csv":
            # Every column is a string ("007" stays "007"); an empty cell is "", not a float NaN.
            check_utf8(path)
            with path.open(newline="", encoding="utf-8-sig") as handle:  # a spreadsheet's byte order mark
                reader = csv.reader(handle)
                header, first = next(reader, None), next(reader, None)
            if not header or first is None:
                raise DataValidationError(f"{path}: the dataset has no rows")
            features = datasets.Features({column: datasets.Value("string") for column in header})
            options = {"features": features, "keep_default_na": False, "encoding": "utf-8-sig"}
        # The builder converts the file to an Arrow copy in its cache (by default the user's
        # ~/.cache/huggingface/datasets, one copy per version of the file, never read again): here a
        # scratch folder, gone once the rows are read.
        with tempfile.TemporaryDirectory(prefix="alignflow-read-") as scratch:
            dataset = datasets.load_dataset(
                LOCAL_BUILDERS[suffix], data_files=str(path), split="train", cache_dir=scratch, **options
            )
            return dataset.to_list()
    except UnicodeDecodeError as error:
        raise DataValidationError(f"{path}: not UTF-8 text (byte {error.start}: {error.reason})") from None
    except DataValidationError:
        raise
    except Exception as error:  # pyarrow / pandas errors name neither the file nor the cause clearly
        raise DataValidationError(f"{path}: cannot read as {suffix[1:]}: {type(error).__name__}: {error}") from None


def check_utf8(path: Path) -> None:
    """Raise :class:`DataValidationError` with the line and byte offset of the first non-UTF-8 byte."""
    offset = 0
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as error:
                raise DataValidationError(
                    f"{path}: line {number}: not UTF-8 text (byte {offset + error.start}: {error.reason})"
                ) from None
            offset += len(line)


def read_json_rows(path: Path) -> list[dict]:
    """A ``.jsonl`` file (one object per line) or a ``.json`` file holding a list of objects."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        line = path.read_bytes()[: error.start].count(b"\n") + 1
        raise DataValidationError(f"{path}: line {line}: not UTF-8 text (byte {error.start}: {error.reason})") from None
    if path.suffix.lower() == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as error:
            raise DataValidationError(
                f"{path}: line {error.lineno} column {error.colno}: invalid JSON ({error.msg})"
            ) from None
    else:
        rows = []
        for number, json_line in enumerate(text.splitlines()):
            if json_line.strip():
                try:
                    rows.append(json.loads(json_line))
                except json.JSONDecodeError as error:
                    raise DataValidationError(f"{path}: line {number + 1}: invalid JSON ({error.msg})") from None
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise DataValidationError(f"{path}: expected JSON objects, one per row")
    return rows


def rename_columns(rows: list[dict], columns: dict[str, str], source: str) -> list[dict]:
    """Each row with column ``columns[field]`` renamed to ``field``; a missing column is reported
    as the missing field (with the column it was mapped from)."""
    if not columns:
        return rows
    renamed = []
    for index, row in enumerate(rows):
        out = {k: v for k, v in row.items() if k not in columns.values()}
        for field, column in columns.items():
            if row.get(column) is None:
                raise DataValidationError(f"{source}: row {index}: field '{field}' (column '{column}') is missing")
            out[field] = row[column]
        renamed.append(out)
    return renamed


# --- normalizing and validating ------------------------------------------------------------------


def _is_conversation(value: object) -> TypeGuard[list[dict]]:
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
        )
    )


def _message_key(message: dict) -> tuple[str, str]:
    return message["role"], message["content"]


def shared_text_prefix(chosen: str, rejected: str) -> int:
    """Where an implicit-prompt pair of strings parts (TRL's standard implicit-prompt format): the
    length of their common prefix, less the space before the first differing character, which
    starts the completions (``"The sky is"`` + ``" blue."`` / ``" green."``)."""
    common = next((i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b), min(len(chosen), len(rejected)))
    return common - 1 if common > 0 and chosen[common - 1] == " " else common


def shared_message_prefix(chosen: list[dict], rejected: list[dict]) -> int:
    """How many leading messages an implicit-prompt pair of conversations shares; each side keeps at
    least its last message."""
    common = 0
    while common < min(len(chosen), len(rejected)) - 1 and _message_key(chosen[common]) == _message_key(
        rejected[common]
    ):
        common += 1
    return common


def split_implicit_prompt(row: dict, where: str) -> dict:
    """A preference pair without ``prompt`` whose ``chosen`` and ``rejected`` are both conversations
    or both strings, with their shared beginning as the prompt; any other row as it is (validation
    then names what is missing)."""
    chosen, rejected = row.get("chosen"), row.get("rejected")
    if _is_conversation(chosen) and _is_conversation(rejected):
        common, unit = shared_message_prefix(chosen, rejected), "message"
    elif isinstance(chosen, str) and isinstance(rejected, str):
        common, unit = shared_text_prefix(chosen, rejected), "text"
    else:
        return row
    if common == 0:
        raise DataValidationError(
            f"{where}: field 'prompt' is missing and 'chosen' and 'rejected' share no leading {unit} (implicit prompt)"
        )
    return {**row, "prompt": chosen[:common], "chosen": chosen[common:], "rejected": rejected[common:]}


def normalize_rows(rows: list[dict], split: str, source: str) -> list[dict]:
    """Rows in the split's ``prompt``/``completion``/``chosen``/``rejected`` fields: SFT
    ``messages`` are split before the last assistant turn; preference pairs without ``prompt``
    take the shared beginning of ``chosen`` and ``rejected`` as the prompt (:func:`split_implicit_prompt`)."""
    out = []
    for index, row in enumerate(rows):
        where = f"{source}: row {index}"
        if split in ("sft", "sft_eval") and "prompt" not in row and "completion" not in row and "messages" in row:
            messages = row["messages"]
            if not _is_conversation(messages):
                raise DataValidationError(f"{where}: field 'messages' must be a list of {{role, content}} messages")
            last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
            if last is None:
                raise DataValidationError(f"{where}: field 'messages' has no assistant message")
            if last == 0:
                raise DataValidationError(f"{where}: field 'messages' has no message before the assistant turn")
            row = {k: v for k, v in row.items() if k != "messages"}
            row.update(prompt=messages[:last], completion=messages[last:])
        elif split in ("preference", "preference_eval") and "prompt" not in row:
            row = split_implicit_prompt(row, where)
        out.append(row)
    return out


def validate_rows(rows: Iterable[dict], fields: tuple[str, ...], source: str) -> None:
    """Raise :class:`DataValidationError` at the first missing, empty or mistyped field."""
    for index, row in enumerate(rows):
        for field in fields:
            where = f"{source}: row {index}: field '{field}'"
            value = row.get(field)
            if value is None:
                raise DataValidationError(f"{where} is missing")
            if isinstance(value, str):
                if field in COMPLETION_FIELDS and not value.strip():
                    raise DataValidationError(f"{where} is an empty completion")
            elif not _is_conversation(value):
                raise DataValidationError(
                    f"{where} must be a string or a list of {{role, content}} messages, got {type(value).__name__}"
                )
            elif field in COMPLETION_FIELDS and not any(m["content"].strip() for m in value):
                raise DataValidationError(f"{where} is an empty completion")
            if field in COMPLETION_FIELDS and isinstance(row.get("prompt"), str) and not isinstance(value, str):
                raise DataValidationError(
                    f"{where} is conversational but 'prompt' is a string; "
                    "a conversational completion continues a conversational prompt"
                )


# --- rendering -----------------------------------------------------------------------------------


class TemplateError(ValueError):
    """The chat template cannot render a completion as the continuation of its prompt."""


def render_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: str | list[dict], clip: TextClip | None = None
) -> list[int]:
    """The prompt's token ids (a conversation: rendered with the generation prompt); its text is
    clipped first when a ``clip`` is given (:mod:`trainers.data.clipping`)."""
    clipped = clip.prompt if clip is not None else str
    if isinstance(prompt, str):
        return tokenizer(clipped(prompt)).input_ids
    text = rendered_text(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False))
    return tokenizer(clipped(text), add_special_tokens=False).input_ids


def completion_text(tokenizer: PreTrainedTokenizerBase, prompt: list[dict], completion: list[dict]) -> str:
    """The template's render of ``prompt + completion`` after the render of ``prompt`` with the
    generation prompt, which must be its prefix. Whitespace the template puts after a final
    special token (ChatML's newline after ``<|im_end|>``) is not part of it: generation stops at
    the end-of-turn token, so the end-of-turn token is the completion's last token."""
    prompt_text = rendered_text(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False))
    full_text = rendered_text(tokenizer.apply_chat_template(prompt + completion, tokenize=False))
    if not full_text.startswith(prompt_text):
        raise TemplateError(
            "the chat template is not prefix-stable: the conversation's render does not start with the "
            f"prompt's render with the generation prompt (it ends {prompt_text[-40:]!r})"
        )
    text = full_text[len(prompt_text) :]
    stripped = text.rstrip()
    if stripped != text and any(
        stripped.endswith(token) for token in [*tokenizer.all_special_tokens, *tokenizer.get_added_vocab()]
    ):
        return stripped
    return text


def render_completion(
    tokenizer: PreTrainedTokenizerBase,
    completion: str | list[dict],
    prompt: str | list[dict] | None = None,
    clip: TextClip | None = None,
    ended: bool = True,
) -> list[int]:
    """A string completion: its tokens then EOS. A conversational one: the template's
    continuation of the conversational ``prompt`` (:func:`completion_text`). The text is clipped
    first when a ``clip`` is given (:mod:`trainers.data.clipping`): the EOS then follows a cut completion
    that truncation cuts before it anyway. A completion that did not end (``ended=False``: sampled
    up to a length limit) gets no EOS, and a conversational one the continuation only up to the end
    of its text (:func:`unended_text`): no end of turn."""
    clipped = clip.completion if clip is not None else str
    if isinstance(completion, str):
        ids = tokenizer(clipped(completion), add_special_tokens=False).input_ids
        return ids + [tokenizer.eos_token_id] if ended else ids
    if not isinstance(prompt, list):
        raise TemplateError("a conversational completion needs a conversational prompt")
    text = completion_text(tokenizer, prompt, completion)
    if not ended:
        text = unended_text(text, completion[-1]["content"])
    return tokenizer(clipped(text), add_special_tokens=False).input_ids


def unended_text(continuation: str, content: str) -> str:
    """The template's ``continuation`` of a turn whose text is ``content``, up to the end of that
    text: what the template puts after it (the end of turn) is left out."""
    if not content:
        return ""
    end = continuation.rfind(content)
    if end < 0:
        raise TemplateError(
            f"the chat template does not render the completion's text as written ({content[-40:]!r} is not in "
            f"its render {continuation[-80:]!r}): a truncated completion cannot be rendered without its end of turn"
        )
    return continuation[: end + len(content)]


# --- truncation and tokenization -----------------------------------------------------------------


def truncate_prompt(prompt_ids: list[int], truncation: Truncation) -> list[int]:
    limit = truncation.max_prompt_length
    if len(prompt_ids) <= limit or truncation.mode == "drop":
        return prompt_ids
    return prompt_ids[-limit:] if truncation.mode == "keep_end" else prompt_ids[:limit]


@dataclass(frozen=True)
class RenderedRow:
    """One row's whole token ids, before truncation: what the lengths are read from
    (:mod:`trainers.data.lengths`) and what :func:`truncate_rows` cuts. ``terminated``: every completion
    ends with a stop token (:mod:`trainers.models.stop_tokens`)."""

    prompt_ids: list[int]
    completions: dict[str, list[int]]  # field (completion, chosen, rejected) -> ids
    answer: str | None
    terminated: bool
    source_row: str | None = None  # the row as read, JSON (REWARD_SPLITS only)
    margin: float | None = None  # a preference pair's ``margin`` column, when it has one
    label: bool | None = None  # an unpaired row's ``label``

    @property
    def longest(self) -> int:
        """The longest completion's length (0 for a prompt-only row)."""
        return max(map(len, self.completions.values()), default=0)


@dataclass
class TokenizedSplit:
    """The rows kept; how many were dropped (truncation left a completion with no tokens, or
    ``drop`` mode and the row did not fit); how many kept rows had their prompt cut, and how many
    had a completion cut; how many kept rows have a completion whose render does not end with a
    stop token: a model trained on them learns no place to stop."""

    rows: list[dict]
    dropped: int
    truncated_prompts: int
    unterminated: int
    truncated_completions: int = 0
    kept_cut: int = 0  # kept rows with their prompt or a completion cut (both: once)
    identical: int = 0  # pairs left out because chosen and rejected render alike: they teach nothing

    @property
    def cut(self) -> int:
        """Rows that lost tokens: dropped, or kept with their prompt or a completion cut."""
        return self.dropped + self.kept_cut


def render_rows(
    rows: list[dict], split: str, tokenizer: PreTrainedTokenizerBase, source: str = "data", clip: TextClip | None = None
) -> list[RenderedRow]:
    """Render one split's (normalized, validated) rows to token ids, each text clipped first by
    ``clip`` (:mod:`trainers.data.clipping`); a row the chat template cannot render raises
    :class:`DataValidationError` naming ``source`` and the row."""
    completion_fields = [f for f in SPLIT_FIELDS[split] if f in COMPLETION_FIELDS]
    stops = set(stop_token_ids(tokenizer)) if completion_fields else set()
    rendered = []
    for index, row in enumerate(rows):
        try:
            prompt = render_prompt(tokenizer, row["prompt"], clip)
            completions = {f: render_completion(tokenizer, row[f], row["prompt"], clip) for f in completion_fields}
        except Exception as error:  # jinja errors, TemplateError
            raise DataValidationError(f"{source}: row {index}: {type(error).__name__}: {error}") from None
        terminated = all(ids and ids[-1] in stops for ids in completions.values())
        answer = str(row["answer"]) if "answer" in row else None
        source_row = json.dumps(row, default=str) if split in REWARD_SPLITS else None
        margin = pair_margin(row, f"{source}: row {index}") if split in PAIR_SPLITS else None
        label = unpaired_label(row, f"{source}: row {index}") if split == "unpaired" else None
        rendered.append(RenderedRow(prompt, completions, answer, terminated, source_row, margin, label))
    return rendered


def unpaired_label(row: dict, where: str) -> bool:
    """An unpaired row's ``label``: a bool, or a CSV file's text ``true`` / ``false``."""
    value = row.get(LABEL)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if value is None:
        raise DataValidationError(f"{where}: field '{LABEL}' is missing")
    raise DataValidationError(f"{where}: field '{LABEL}' must be true or false, got {value!r}")


def pair_margin(row: dict, where: str) -> float | None:
    """A preference row's ``margin``: a finite number (a CSV file's text of one too); None without one."""
    value = row.get(MARGIN)
    if value is None:
        return None
    try:
        if isinstance(value, bool):
            raise ValueError
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number):
        raise DataValidationError(f"{where}: field '{MARGIN}' must be a finite number, got {value!r}")
    return number


def truncate_rows(rendered: list[RenderedRow], truncation: Truncation) -> TokenizedSplit:
    """Cut (or, in ``drop`` mode, drop) the rendered rows to ``truncation``'s lengths; leave out
    preference pairs whose chosen and rejected completions are the same tokens."""
    kept, dropped, prompts_cut, completions_cut, kept_cut, unterminated, identical = [], 0, 0, 0, 0, 0, 0
    for row in rendered:
        if "chosen" in row.completions and row.completions["chosen"] == row.completions["rejected"]:
            identical += 1
            continue
        if truncation.mode == "drop" and (
            len(row.prompt_ids) > truncation.max_prompt_length
            or len(row.prompt_ids) + row.longest > truncation.max_length
        ):
            dropped += 1
            continue
        prompt_ids = truncate_prompt(row.prompt_ids, truncation)
        budget = max(truncation.max_length - len(prompt_ids), 0)
        completions = {f"{field}_ids": ids[:budget] for field, ids in row.completions.items()}
        if any(len(ids) == 0 for ids in completions.values()):
            dropped += 1
            continue
        out: dict[str, list[int] | str | float | bool] = {"prompt_ids": prompt_ids, **completions}
        prompt_cut, completion_cut = len(prompt_ids) < len(row.prompt_ids), row.longest > budget
        prompts_cut += prompt_cut
        completions_cut += completion_cut
        kept_cut += prompt_cut or completion_cut
        unterminated += not row.terminated
        if row.answer is not None:
            out["answer"] = row.answer
        if row.source_row is not None:
            out[SOURCE_ROW] = row.source_row
        if row.margin is not None:
            out[MARGIN] = row.margin
        if row.label is not None:
            out[LABEL] = row.label
        kept.append(out)
    return TokenizedSplit(kept, dropped, prompts_cut, unterminated, completions_cut, kept_cut, identical)


def tokenize_rows(
    rows: list[dict], split: str, tokenizer: PreTrainedTokenizerBase, truncation: Truncation, source: str = "data"
) -> TokenizedSplit:
    """Render then truncate one split's rows (:func:`render_rows`, :func:`truncate_rows`)."""
    return truncate_rows(render_rows(rows, split, tokenizer, source), truncation)


def tokenize_split(
    rows: list[dict], split: str, tokenizer: PreTrainedTokenizerBase, truncation: Truncation
) -> tuple[list[dict], int]:
    """Tokenize one split; returns the rows kept and how many were dropped (see :func:`tokenize_rows`)."""
    result = tokenize_rows(rows, split, tokenizer, truncation)
    return result.rows, result.dropped


# --- mixing --------------------------------------------------------------------------------------


def select_rows(rows: list[dict], weight: float | None, num_samples: int | None, rng: random.Random) -> list[dict]:
    """All ``rows`` (neither given), ``num_samples`` of them or ``round(weight * len(rows))``: every
    row as many whole times as fit, then a sample without replacement for the rest (kept in order)."""
    if num_samples is not None:
        target = num_samples
    elif weight is not None:
        target = round(weight * len(rows))
    else:
        return rows
    whole, rest = divmod(target, len(rows)) if rows else (0, 0)
    picked = list(range(len(rows))) * whole + sorted(rng.sample(range(len(rows)), rest))
    return [rows[i] for i in picked]


def mixing_rng(seed: int, split: str, source_index: int) -> random.Random:
    """The sampler of one source of one split: the same for the same seed on every machine."""
    return random.Random(f"alignflow-mix/{seed}/{split}/{source_index}")
