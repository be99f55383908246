"""A registered speaker belongs to the model family that computed its prompt: ``speaker add`` on a CosyVoice2 or a
CosyVoice3 folder records it, and a model of the other family refuses the speaker with an error naming both."""

from __future__ import annotations

import pytest
from conftest import FIXTURES

from cosyvoice_triton.__main__ import main as cli
from cosyvoice_triton.models.demo import write_demo_model
from cosyvoice_triton.speakers import SpeakerStore

PROMPT = str(FIXTURES / "prompt_en_3s.wav")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    assert cli(["demo-model", "--family", "cosyvoice3", "--out", str(root / "cv3"), "--seed", "3"]) == 0
    return {"cosyvoice2": str(write_demo_model(root / "cv2", size="tiny", seed=0)), "cosyvoice3": str(root / "cv3")}


def test_speaker_add_records_the_folder_family_and_the_other_family_refuses_it(folders, tmp_path, capsys):
    spk = str(tmp_path / "spk")
    for speaker_id, family in (("bob", "cosyvoice2"), ("eve", "cosyvoice3")):
        assert cli(["speaker", "add", speaker_id, "--model-dir", folders[family], "--prompt-audio", PROMPT,
                    "--speaker-dir", spk]) == 0
        assert f"registered {speaker_id!r} for {family}" in capsys.readouterr().out
    store = SpeakerStore(spk)
    assert (store.get("bob").family, store.get("eve").family) == ("cosyvoice2", "cosyvoice3")
    # the two families tokenize and mel the same recording differently
    assert store.get("bob").prompt_tokens.tolist() != store.get("eve").prompt_tokens.tolist()
    for speaker_id, registered, used in (("eve", "cosyvoice3", "cosyvoice2"), ("bob", "cosyvoice2", "cosyvoice3")):
        out = tmp_path / f"{speaker_id}.wav"
        assert cli(["tts", "--model-dir", folders[used], "--text", "Hello there.", "--speaker", speaker_id,
                    "--speaker-dir", spk, "-o", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"speaker {speaker_id!r} was registered with a {registered} model and cannot be used by this {used} " \
               "model" in err and "register it again with this model" in err
