"""Registered speakers: a prompt's tokens, mel and embedding computed once and reused by id.

A :class:`SpeakerPrompt` holds what the flow and the LM need from a prompt recording; a :class:`SpeakerStore`
keeps prompts under ids, least recently used first out of memory, and optionally one ``<id>.npz`` file per
speaker in a folder, so that registered speakers survive a restart::

    store = SpeakerStore("speakers/", capacity=1000)
    store.put("alice", SpeakerPrompt(prompt_tokens=tok, prompt_mel=mel, embedding=emb, family="cosyvoice2"))
    prompt = store.get("alice", family="cosyvoice2")

A prompt belongs to the model family that computed it (CosyVoice2: speech_tokenizer_v2 tokens and a mel up to
8 kHz; CosyVoice3: speech_tokenizer_v3 tokens and a mel without an upper limit), so :meth:`SpeakerStore.get` with
``family`` refuses a speaker of the other family. Files written before the family was recorded read as CosyVoice2.

Ids are 1-64 ASCII characters of ``[A-Za-z0-9_.-]`` that do not start with ``.``: they are the file names, so
no id can reach outside the folder. The store is safe to share between threads of one process; two processes
writing the same folder are not supported (each keeps its own index and would not see the other's changes).
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import SpeakerError, shown
from .family import COSYVOICE2, COSYVOICE3

__all__ = ["EMBEDDING_DIM", "FILE_VERSION", "LEGACY_FAMILY", "MEL_BINS", "SpeakerPrompt", "SpeakerStore",
           "validate_speaker_id"]

log = logging.getLogger(__name__)

#: Size of the CAM++ speaker embedding.
EMBEDDING_DIM = 192
#: Mel bins of the flow's 24 kHz prompt mel (50 frames/s, two frames per 25 Hz speech token).
MEL_BINS = 80
#: Version written in every speaker file; files of another version are skipped.
FILE_VERSION = 1

_ID_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}")
_ARRAYS = ("prompt_tokens", "prompt_mel", "embedding", "prompt_text_tokens")
_TMP_PREFIX = ".tmp-"
#: The families whose prompts a speaker can hold (the ones with a prompt front end).
_FAMILIES = (COSYVOICE2, COSYVOICE3)
#: The family of a speaker file written before the family was recorded (only CosyVoice2 registered speakers then).
LEGACY_FAMILY = COSYVOICE2


def validate_speaker_id(speaker_id: object) -> str:
    """Return ``speaker_id`` if it is a valid id, else raise :class:`SpeakerError` saying why."""
    if not isinstance(speaker_id, str) or _ID_RE.fullmatch(speaker_id) is None:
        raise SpeakerError(f"speaker_id {shown(speaker_id)} is invalid: use 1-64 characters of A-Z a-z 0-9 _ . - "
                           "not starting with '.'")
    return speaker_id


def _frozen(name: str, value: object, dtype: type, ndim: int) -> np.ndarray:
    if not isinstance(value, np.ndarray) or value.dtype != dtype or value.ndim != ndim:
        got = f"{value.dtype} with {value.ndim} dims" if isinstance(value, np.ndarray) else type(value).__name__
        raise SpeakerError(f"{name} must be a {ndim}-D {np.dtype(dtype)} array, got {got}")
    if dtype is np.float32 and not np.isfinite(value).all():
        raise SpeakerError(f"{name} has non-finite values")
    if dtype is np.int32 and value.size and value.min() < 0:
        raise SpeakerError(f"{name} has negative token ids")
    out = np.array(value, copy=True, order="C")
    out.setflags(write=False)
    return out


@dataclass(frozen=True, eq=False)
class SpeakerPrompt:
    """A registered speaker's prompt; arrays are validated and kept as read-only copies.

    ``prompt_tokens`` int32 [Tp] 25 Hz speech tokens (Tp >= 1); ``prompt_mel`` float32 [2*Tp, 80] 24 kHz mel;
    ``embedding`` float32 [192] CAM++ embedding; ``prompt_text_tokens`` int32 [Tt] Qwen2 ids of the transcript
    and ``prompt_text`` the transcript, both empty when it is unknown (cross-lingual use); ``family`` the model
    family that computed the prompt (``"cosyvoice2"`` or ``"cosyvoice3"``).
    """

    prompt_tokens: np.ndarray
    prompt_mel: np.ndarray
    embedding: np.ndarray
    prompt_text_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    prompt_text: str = ""
    family: str = COSYVOICE2

    def __post_init__(self) -> None:
        for name, dtype, ndim in zip(_ARRAYS, (np.int32, np.float32, np.float32, np.int32), (1, 2, 1, 1), strict=True):
            object.__setattr__(self, name, _frozen(name, getattr(self, name), dtype, ndim))
        tp = self.prompt_tokens.shape[0]
        if tp == 0:
            raise SpeakerError("prompt_tokens is empty")
        if self.prompt_mel.shape != (2 * tp, MEL_BINS):
            raise SpeakerError(f"prompt_mel must be [2*Tp, {MEL_BINS}] = [{2 * tp}, {MEL_BINS}] for Tp={tp} "
                               f"prompt tokens, got {list(self.prompt_mel.shape)}")
        if self.embedding.shape != (EMBEDDING_DIM,):
            raise SpeakerError(f"embedding must have {EMBEDDING_DIM} values, got {self.embedding.shape[0]}")
        if not isinstance(self.prompt_text, str):
            raise SpeakerError(f"prompt_text must be a str, got {type(self.prompt_text).__name__}")
        if bool(self.prompt_text) != bool(self.prompt_text_tokens.size):
            raise SpeakerError("prompt_text and prompt_text_tokens must be both given or both empty")
        if self.family not in _FAMILIES:
            raise SpeakerError(f"family must be one of {', '.join(_FAMILIES)}, got {shown(self.family)}")

    def require_family(self, family: str, speaker_id: str) -> SpeakerPrompt:
        """This prompt if it was computed by a ``family`` model, else :class:`SpeakerError` naming both."""
        if self.family != family:
            raise SpeakerError(f"speaker {speaker_id!r} was registered with a {self.family} model and cannot be used "
                               f"by this {family} model (the two compute a prompt's speech tokens and mel "
                               f"differently): register it again with this model (the same id replaces it)")
        return self


class SpeakerStore:
    """Speakers by id: an LRU of at most ``capacity`` prompts in memory, optionally persisted in ``directory``.

    Without a folder a speaker pushed out of memory is forgotten. With one, every speaker is also a
    ``<id>.npz`` file (written atomically: a temp file in the folder, fsync, ``os.replace``); a speaker
    pushed out of memory stays known and is read back on its next :meth:`get`, and :meth:`put` of a new id
    fails once ``max_persisted`` (default ``capacity``) speakers are stored. Files that cannot be read, of
    another version, or with a name that is not an id are skipped with a warning when the store opens.
    One lock serialises all calls; the safety holds between threads of one process only.
    """

    def __init__(self, directory: str | Path | None = None, *, capacity: int = 1000,
                 max_persisted: int | None = None) -> None:
        if capacity < 1:
            raise SpeakerError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.max_persisted = capacity if max_persisted is None else max_persisted
        if self.max_persisted < 1:
            raise SpeakerError(f"max_persisted must be >= 1, got {self.max_persisted}")
        self.directory = None if directory is None else Path(directory)
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, SpeakerPrompt] = OrderedDict()
        self._on_disk: set[str] = set()
        self._forget: list[Callable[[SpeakerPrompt], None]] = []
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._scan()

    def _path(self, speaker_id: str) -> Path:
        return self.directory / f"{speaker_id}.npz"

    def on_forget(self, callback: Callable[[SpeakerPrompt], None]) -> None:
        """Call ``callback(prompt)`` with a speaker's prompt when :meth:`delete` removes it or :meth:`put`
        replaces it (e.g. to drop what was computed from it: :class:`~.speaker_state.SpeakerState`)."""
        self._forget.append(callback)

    def _forgotten(self, prompt: SpeakerPrompt | None) -> None:
        for callback in self._forget if prompt is not None else ():
            try:
                callback(prompt)
            except Exception:  # a listener's failure must not undo the store's change
                log.exception("speaker store: an on_forget callback failed")

    def _known_prompt(self, speaker_id: str) -> SpeakerPrompt | None:
        """The prompt now under ``speaker_id`` for the listeners (read back from its file when it is no longer
        in memory; None without listeners or speaker). Called under the lock."""
        if not self._forget:
            return None
        prompt = self._cache.get(speaker_id)
        if prompt is None and speaker_id in self._on_disk:
            prompt = self._load(self._path(speaker_id))
        return prompt

    def _scan(self) -> None:
        entries = sorted((p for p in self.directory.iterdir() if p.is_file()), key=lambda p: p.stat().st_mtime)
        for path in entries:
            if path.name.startswith(_TMP_PREFIX):
                log.warning("removing %s: left by an interrupted write", path)
                path.unlink(missing_ok=True)
                continue
            if path.suffix != ".npz" or _ID_RE.fullmatch(path.stem) is None:
                log.warning("skipping %s: not a speaker file (<id>.npz)", path)
                continue
            prompt = self._load(path)
            if prompt is not None:
                self._on_disk.add(path.stem)
                self._remember(path.stem, prompt)  # oldest first, so the newest `capacity` stay in memory

    @staticmethod
    def _load(path: Path) -> SpeakerPrompt | None:
        try:
            with np.load(path, allow_pickle=False) as data:
                version = int(data["version"])
                if version != FILE_VERSION:
                    raise ValueError(f"file version {version}, expected {FILE_VERSION}")
                strings = {}
                for name in ("prompt_text", "family"):
                    if name == "family" and name not in data.files:
                        strings[name] = LEGACY_FAMILY
                        continue
                    value = data[name]
                    if value.dtype.kind != "U" or value.ndim != 0:
                        raise ValueError(f"{name} is not a 0-d unicode array")
                    strings[name] = str(value[()])
                return SpeakerPrompt(**{k: data[k] for k in _ARRAYS}, **strings)
        except Exception as e:  # anything in the folder may be corrupt or foreign: never crash on it
            log.warning("skipping speaker file %s: %s: %s", path, type(e).__name__, e)
            return None

    def _remember(self, speaker_id: str, prompt: SpeakerPrompt) -> None:
        self._cache[speaker_id] = prompt
        self._cache.move_to_end(speaker_id)
        while len(self._cache) > self.capacity:
            self._cache.popitem(last=False)

    def _write_temp(self, prompt: SpeakerPrompt) -> str:
        fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=".npz", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, version=np.int32(FILE_VERSION), prompt_text=np.array(prompt.prompt_text, dtype=np.str_),
                         family=np.array(prompt.family, dtype=np.str_), **{k: getattr(prompt, k) for k in _ARRAYS})
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            os.unlink(tmp)
            raise
        return tmp

    def put(self, speaker_id: str, prompt: SpeakerPrompt, *, overwrite: bool = True) -> None:
        """Register ``prompt`` under ``speaker_id`` (replacing an existing one unless ``overwrite=False``)."""
        validate_speaker_id(speaker_id)
        if not isinstance(prompt, SpeakerPrompt):
            raise SpeakerError(f"prompt must be a SpeakerPrompt, got {type(prompt).__name__}")
        tmp = None if self.directory is None else self._write_temp(prompt)  # the slow part, outside the lock
        try:
            with self._lock:
                known = speaker_id in self._cache or speaker_id in self._on_disk
                if known and not overwrite:
                    raise SpeakerError(f"speaker {speaker_id!r} already exists (overwrite=False)")
                old = self._known_prompt(speaker_id) if known else None
                if tmp is not None:
                    if not known and len(self._on_disk) >= self.max_persisted:
                        raise SpeakerError(f"cannot add speaker {speaker_id!r}: the store holds max_persisted="
                                           f"{self.max_persisted} speakers; delete one first")
                    os.replace(tmp, self._path(speaker_id))
                    tmp = None
                    self._on_disk.add(speaker_id)
                self._remember(speaker_id, prompt)
        finally:
            if tmp is not None:
                os.unlink(tmp)
        self._forgotten(old)

    def get(self, speaker_id: str, *, family: str | None = None) -> SpeakerPrompt:
        """The prompt registered under ``speaker_id``; :class:`SpeakerError` if there is none, or if ``family`` is
        given and the prompt was computed by a model of another family."""
        prompt = self._get(speaker_id)
        return prompt if family is None else prompt.require_family(family, speaker_id)

    def _get(self, speaker_id: str) -> SpeakerPrompt:
        validate_speaker_id(speaker_id)
        with self._lock:
            prompt = self._cache.get(speaker_id)
            if prompt is not None:
                self._cache.move_to_end(speaker_id)
                return prompt
            if speaker_id in self._on_disk:
                prompt = self._load(self._path(speaker_id))
                if prompt is not None:
                    self._remember(speaker_id, prompt)
                    return prompt
                self._on_disk.discard(speaker_id)
                raise SpeakerError(f"speaker {speaker_id!r} could not be read back from its file")
        raise SpeakerError(f"unknown speaker {speaker_id!r}")

    def delete(self, speaker_id: str) -> None:
        """Forget ``speaker_id`` and remove its file; :class:`SpeakerError` if it is unknown."""
        validate_speaker_id(speaker_id)
        with self._lock:
            old = self._known_prompt(speaker_id)
            in_memory = self._cache.pop(speaker_id, None) is not None
            if speaker_id in self._on_disk:
                self._on_disk.discard(speaker_id)
                self._path(speaker_id).unlink(missing_ok=True)
            elif not in_memory:
                raise SpeakerError(f"unknown speaker {speaker_id!r}")
        self._forgotten(old)

    def list(self) -> list[str]:
        """All registered ids, sorted."""
        with self._lock:
            return sorted(self._on_disk.union(self._cache))

    def cached(self) -> list[str]:
        """The ids held in memory, least recently used first."""
        with self._lock:
            return list(self._cache)

    def __contains__(self, speaker_id: object) -> bool:
        with self._lock:
            return speaker_id in self._cache or speaker_id in self._on_disk

    def __len__(self) -> int:
        with self._lock:
            return len(self._on_disk.union(self._cache))
