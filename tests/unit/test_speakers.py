import dataclasses
import logging
import random
import threading

import numpy as np
import pytest

from cosyvoice_triton.errors import CosyVoiceError, SpeakerError
from cosyvoice_triton.speakers import LEGACY_FAMILY, SpeakerPrompt, SpeakerStore


def make_prompt(seed: int = 0, tp: int = 7, text: str = "hello there") -> SpeakerPrompt:
    rng = np.random.default_rng(seed)
    return SpeakerPrompt(
        prompt_tokens=rng.integers(0, 6561, tp).astype(np.int32),
        prompt_mel=rng.standard_normal((2 * tp, 80)).astype(np.float32),
        embedding=rng.standard_normal(192).astype(np.float32),
        prompt_text_tokens=np.arange(len(text.split()), dtype=np.int32) + seed if text else np.zeros(0, np.int32),
        prompt_text=text,
    )


def assert_same(a: SpeakerPrompt, b: SpeakerPrompt) -> None:
    for name in ("prompt_tokens", "prompt_mel", "embedding", "prompt_text_tokens"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    assert a.prompt_text == b.prompt_text
    assert a.family == b.family


def test_prompt_is_a_read_only_copy():
    tokens = np.arange(3, dtype=np.int32)
    p = SpeakerPrompt(prompt_tokens=tokens, prompt_mel=np.zeros((6, 80), np.float32),
                      embedding=np.zeros(192, np.float32))
    tokens[0] = 99
    assert p.prompt_tokens[0] == 0
    assert p.prompt_text == "" and p.prompt_text_tokens.shape == (0,)
    with pytest.raises(ValueError):
        p.prompt_mel[0, 0] = 1.0


@pytest.mark.parametrize("change, match", [
    (dict(prompt_tokens=np.arange(7, dtype=np.int64)), "prompt_tokens must be a 1-D int32"),
    (dict(prompt_mel=np.zeros((14, 80), np.float64)), "prompt_mel must be a 2-D float32"),
    (dict(prompt_mel=np.full((14, 80), np.nan, np.float32)), "prompt_mel has non-finite"),
    (dict(embedding=np.array([np.inf] * 192, np.float32)), "embedding has non-finite"),
    (dict(prompt_mel=np.zeros((13, 80), np.float32)), r"prompt_mel must be \[2\*Tp, 80\] = \[14, 80\]"),
    (dict(prompt_mel=np.zeros((14, 100), np.float32)), r"got \[14, 100\]"),
    (dict(embedding=np.zeros(191, np.float32)), "embedding must have 192 values, got 191"),
    (dict(embedding=[0.0] * 192), "got list"),
    (dict(prompt_tokens=np.zeros(0, np.int32), prompt_mel=np.zeros((0, 80), np.float32)), "prompt_tokens is empty"),
    (dict(prompt_tokens=np.full(7, -1, np.int32)), "negative token ids"),
    (dict(prompt_text=""), "both given or both empty"),
    (dict(prompt_text=b"hi"), "prompt_text must be a str"),
])
def test_prompt_validation(change, match):
    fields = {k: getattr(make_prompt(), k) for k in
              ("prompt_tokens", "prompt_mel", "embedding", "prompt_text_tokens", "prompt_text")}
    with pytest.raises(SpeakerError, match=match) as info:
        SpeakerPrompt(**{**fields, **change})
    assert isinstance(info.value, CosyVoiceError)


@pytest.mark.parametrize("bad", ["../x", "", "a" * 65, "a/b", ".hidden", "naïve", "日本", "a b", "a\n", 5, None])
def test_bad_ids_refused(tmp_path, bad):
    store = SpeakerStore(tmp_path)
    for call in (lambda: store.put(bad, make_prompt()), lambda: store.get(bad), lambda: store.delete(bad)):
        with pytest.raises(SpeakerError, match="speaker_id .* is invalid"):
            call()
    assert list(tmp_path.iterdir()) == []
    assert bad not in store


def test_good_ids_accepted():
    store = SpeakerStore()
    ids = ["a", "A-b_c.d", "0" * 64, "x.npz", "-dash"]
    for i, sid in enumerate(ids):
        store.put(sid, make_prompt(i))
    assert store.list() == sorted(ids)


@pytest.mark.parametrize("persist", [False, True])
def test_round_trip(tmp_path, persist):
    store = SpeakerStore(tmp_path if persist else None)
    p, q = make_prompt(1), make_prompt(2, tp=3, text="")
    store.put("alice", p)
    store.put("bob", q)
    assert_same(store.get("alice"), p)
    assert_same(store.get("bob"), q)
    assert "alice" in store and "carol" not in store and len(store) == 2
    assert store.list() == ["alice", "bob"]
    with pytest.raises(SpeakerError, match="unknown speaker 'carol'"):
        store.get("carol")
    with pytest.raises(SpeakerError, match="'alice' already exists"):
        store.put("alice", q, overwrite=False)
    store.put("alice", q)
    assert_same(store.get("alice"), q)


def test_memory_only_lru_forgets():
    store = SpeakerStore(capacity=2)
    for sid in "abc":
        store.put(sid, make_prompt(ord(sid)))
    assert store.list() == ["b", "c"]
    store.get("b")  # b becomes the most recent: d pushes c out
    store.put("d", make_prompt(4))
    assert store.list() == ["b", "d"]
    with pytest.raises(SpeakerError, match="unknown speaker 'a'"):
        store.get("a")


def test_lru_eviction_reloads_from_disk(tmp_path):
    store = SpeakerStore(tmp_path, capacity=2, max_persisted=10)
    prompts = {sid: make_prompt(i) for i, sid in enumerate("abc")}
    for sid, p in prompts.items():
        store.put(sid, p)
    assert store.cached() == ["b", "c"]
    assert store.list() == ["a", "b", "c"] and len(store) == 3
    assert sorted(f.name for f in tmp_path.iterdir()) == ["a.npz", "b.npz", "c.npz"]
    got = store.get("a")  # read back from its file, pushing b out of memory
    assert got is not prompts["a"]
    assert_same(got, prompts["a"])
    assert store.cached() == ["c", "a"]
    assert (tmp_path / "b.npz").exists()


def test_max_persisted_refuses_new_ids(tmp_path):
    store = SpeakerStore(tmp_path, capacity=1, max_persisted=2)
    store.put("a", make_prompt(1))
    store.put("b", make_prompt(2))
    with pytest.raises(SpeakerError, match="max_persisted=2"):
        store.put("c", make_prompt(3))
    store.put("a", make_prompt(4))  # replacing a known id is still allowed
    assert_same(store.get("a"), make_prompt(4))
    assert sorted(f.name for f in tmp_path.iterdir()) == ["a.npz", "b.npz"]


def test_persistence_across_stores(tmp_path):
    first = SpeakerStore(tmp_path)
    first.put("alice", make_prompt(1))
    first.put("bob", make_prompt(2, text=""))
    second = SpeakerStore(tmp_path, capacity=1)
    assert second.list() == ["alice", "bob"] and len(second) == 2
    assert_same(second.get("alice"), make_prompt(1))
    assert_same(second.get("bob"), make_prompt(2, text=""))


def test_delete_removes_file(tmp_path):
    store = SpeakerStore(tmp_path, capacity=1, max_persisted=10)
    store.put("a", make_prompt(1))
    store.put("b", make_prompt(2))  # a is now only on disk
    store.delete("a")
    store.delete("b")
    assert list(tmp_path.iterdir()) == [] and store.list() == [] and len(store) == 0
    with pytest.raises(SpeakerError, match="unknown speaker 'a'"):
        store.delete("a")
    assert SpeakerStore(tmp_path).list() == []


def test_corrupt_and_foreign_files_skipped(tmp_path, caplog):
    SpeakerStore(tmp_path).put("good", make_prompt(1))
    (tmp_path / "broken.npz").write_bytes(b"PK\x03\x04 not really a zip")
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "bad id.npz").write_bytes((tmp_path / "good.npz").read_bytes())
    np.savez(tmp_path / "old.npz", version=np.int32(99), prompt_tokens=np.zeros(1, np.int32))
    np.savez(tmp_path / "pickled.npz", version=np.int32(1), prompt_text=np.array(["x"], dtype=object))
    p = make_prompt(2)
    np.savez(tmp_path / "badmel.npz", version=np.int32(1), prompt_text=np.array(p.prompt_text),
             prompt_tokens=p.prompt_tokens, prompt_mel=p.prompt_mel[:3], embedding=p.embedding,
             prompt_text_tokens=p.prompt_text_tokens)
    (tmp_path / "subdir").mkdir()
    with caplog.at_level(logging.WARNING, logger="cosyvoice_triton.speakers"):
        store = SpeakerStore(tmp_path)
    assert store.list() == ["good"]
    assert_same(store.get("good"), make_prompt(1))
    text = caplog.text
    for name in ("broken.npz", "notes.txt", "bad id.npz", "old.npz", "pickled.npz", "badmel.npz"):
        assert name in text
    assert "file version 99" in text and "prompt_mel must be" in text


def test_file_corrupted_after_open(tmp_path):
    store = SpeakerStore(tmp_path, capacity=1, max_persisted=10)
    store.put("a", make_prompt(1))
    store.put("b", make_prompt(2))
    (tmp_path / "a.npz").write_bytes(b"garbage")
    with pytest.raises(SpeakerError, match="'a' could not be read back"):
        store.get("a")
    assert store.list() == ["b"]


def test_atomic_write_leaves_no_temp_files(tmp_path, monkeypatch):
    store = SpeakerStore(tmp_path)
    for i in range(5):
        store.put("same", make_prompt(i))
    assert [f.name for f in tmp_path.iterdir()] == ["same.npz"]
    with pytest.raises(SpeakerError):
        store.put("same", make_prompt(9), overwrite=False)  # refused after the temp file was written
    assert [f.name for f in tmp_path.iterdir()] == ["same.npz"]

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", crash)
    with pytest.raises(OSError, match="disk full"):
        store.put("same", make_prompt(10))
    monkeypatch.undo()
    assert [f.name for f in tmp_path.iterdir()] == ["same.npz"]
    assert_same(SpeakerStore(tmp_path).get("same"), make_prompt(4))  # the old file is intact
    (tmp_path / ".tmp-leftover.npz").write_bytes(b"half")  # as left by a crash between write and replace
    assert SpeakerStore(tmp_path).list() == ["same"]
    assert [f.name for f in tmp_path.iterdir()] == ["same.npz"]


def test_concurrent_put_get_delete(tmp_path):
    store = SpeakerStore(tmp_path, capacity=3, max_persisted=100)
    ids = [f"s{i}" for i in range(6)]
    prompts = {i: make_prompt(i, tp=4) for i in range(8)}
    errors = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(150):
                sid, op = rng.choice(ids), rng.random()
                try:
                    if op < 0.4:
                        store.put(sid, prompts[seed])
                    elif op < 0.8:
                        got = store.get(sid)
                        assert any(np.array_equal(got.embedding, p.embedding) for p in prompts.values())
                    else:
                        store.delete(sid)
                except SpeakerError as e:
                    assert "unknown speaker" in str(e)
                len(store), store.list(), sid in store
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    listed = store.list()
    assert len(store) == len(listed)
    assert sorted(f.stem for f in tmp_path.iterdir()) == listed  # no temp files, every file indexed
    reopened = SpeakerStore(tmp_path, capacity=100)
    assert reopened.list() == listed
    for sid in listed:
        assert_same(reopened.get(sid), store.get(sid))


def test_family_persists_and_is_checked(tmp_path):
    cv3 = dataclasses.replace(make_prompt(3), family="cosyvoice3")
    SpeakerStore(tmp_path).put("carol", cv3)
    SpeakerStore(tmp_path).put("dave", make_prompt(4))
    store = SpeakerStore(tmp_path)  # read back from the files
    assert (store.get("carol").family, store.get("dave").family) == ("cosyvoice3", "cosyvoice2")
    assert_same(store.get("carol", family="cosyvoice3"), cv3)
    assert_same(store.get("dave", family="cosyvoice2"), make_prompt(4))
    with pytest.raises(SpeakerError, match=r"'carol' was registered with a cosyvoice3 model .* this cosyvoice2 "
                                           r"model .*register it again with this model") as e:
        store.get("carol", family="cosyvoice2")
    assert isinstance(e.value, CosyVoiceError)  # served: a 400 / INVALID_ARGUMENT
    with pytest.raises(SpeakerError, match=r"'dave' was registered with a cosyvoice2 model .* this cosyvoice3"):
        store.get("dave", family="cosyvoice3")
    with pytest.raises(SpeakerError, match="family must be one of cosyvoice2, cosyvoice3, got 'cosyvoice'"):
        dataclasses.replace(make_prompt(1), family="cosyvoice")


def test_files_without_family_read_as_cosyvoice2(tmp_path):
    p = make_prompt(5)
    # a file as written before the family was recorded: the same version, no "family" entry
    np.savez(tmp_path / "legacy.npz", version=np.int32(1), prompt_text=np.array(p.prompt_text),
             **{k: getattr(p, k) for k in ("prompt_tokens", "prompt_mel", "embedding", "prompt_text_tokens")})
    with np.load(tmp_path / "legacy.npz") as data:
        assert "family" not in data.files
    store = SpeakerStore(tmp_path)
    assert store.list() == ["legacy"] and LEGACY_FAMILY == "cosyvoice2"
    assert_same(store.get("legacy", family="cosyvoice2"), p)
    with pytest.raises(SpeakerError, match="cosyvoice2 model and cannot be used by this cosyvoice3 model"):
        store.get("legacy", family="cosyvoice3")


def test_served_speakers_are_cosyvoice2_speakers():
    from cosyvoice_triton.serving.stages.speakers import SpeakerService

    store = SpeakerStore()
    store.put("bob", make_prompt(2))
    store.put("eve", dataclasses.replace(make_prompt(3), family="cosyvoice3"))
    service = SpeakerService(store, None, {})
    assert_same(service.get("bob"), make_prompt(2))
    request = {"action": np.array([[b"get"]], object), "speaker_id": np.array([[b"eve"]], object)}
    for call in (lambda: service.get("eve"), lambda: service.handle(request)):
        with pytest.raises(SpeakerError, match="'eve' was registered with a cosyvoice3 model and cannot be used by "
                                               "this cosyvoice2 model"):
            call()
    assert service.handle({**request, "speaker_id": np.array([[b"bob"]], object)})["prompt_tokens"].size
