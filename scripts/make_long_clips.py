"""Long speech clips for the Whisper long-form tests, synthesized with espeak-ng and flite.

Each clip is a run of distinct English sentences, each spoken by one of several voices at its
own speed (espeak-ng en-us / en-gb / female variants, flite slt / rms / awb), separated by
pauses. The layout is fixed, not random: every 30 s window boundary falls inside a sentence
(a sentence crosses it), and a few long pauses lie inside windows, away from the boundaries.
The ``tail_*`` clips are laid out by hand: their last sentence follows a pause in the last
2-8 s of the file.
Output per clip: ``NAME.wav`` (16 kHz mono PCM16) and ``NAME.json`` (the sentences spoken,
their voice and start/end seconds). Both synthesizers are deterministic, so the same command
writes the same bytes (the tests check it).

    python scripts/make_long_clips.py OUT_DIR [--clips long45 long90 long180 tail_slow ...]

Needs Debian's espeak-ng and flite (scripts/setup.sh installs them) and kvcache (resampling).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import soundfile

RATE = 16000
BOUNDARY_S = 30.0  # Whisper's window
EDGE_S = 0.6  # a boundary nearer than this to a sentence's end moves the sentence
TAIL_S = 0.5  # silence after the last sentence

SENTENCES = [
    "The morning train was late again because of the heavy snow.",
    "My sister bought a small blue car with her first salary.",
    "We walked along the river until the sun went down.",
    "The old library downtown is closed for repairs this month.",
    "Please remember to water the plants while I am away.",
    "He cooked a large pot of soup for the whole family.",
    "The children played football in the park after school.",
    "Our neighbor has a friendly dog that likes to chase birds.",
    "The museum opens at nine and closes early on Sundays.",
    "She wrote a long letter to her grandmother last night.",
    "The meeting was moved to the large room on the second floor.",
    "They planted apple trees behind the house in the spring.",
    "I could not find my keys anywhere this morning.",
    "The weather report says it will rain all weekend.",
    "A young musician played the violin on the corner of the street.",
    "We need to buy bread, milk and eggs before dinner.",
    "The teacher asked the students to read the first chapter.",
    "His office is at the end of the long hallway.",
    "The bakery on the main street sells fresh bread every day.",
    "She forgot her umbrella and got wet on the way home.",
    "The farmer drove his tractor slowly across the field.",
    "After the storm, the sky was clear and full of stars.",
    "The doctor told him to get more sleep and drink more water.",
    "We watched a funny movie and laughed the whole evening.",
    "The small boat sailed out of the harbor at dawn.",
    "My brother is learning to play the piano this year.",
    "The hotel room had a beautiful view of the mountains.",
    "The cat slept on the warm window sill all afternoon.",
    "They painted the kitchen a bright shade of yellow.",
    "Every summer we visit our cousins who live by the sea.",
    "The bus stop is just around the corner from the bank.",
    "She answered every question on the test without any help.",
    "The garden looks lovely now that the roses are in bloom.",
    "He fixed the broken chair with a hammer and some nails.",
    "The new restaurant serves the best pizza in town.",
    "Please close the door quietly when you leave the room.",
    "The students cleaned the classroom before the holiday.",
    "We heard the sound of thunder far away in the hills.",
    "The shop on the corner sells newspapers and coffee.",
    "I like to read a good book before I go to sleep.",
    "The river was too cold for swimming in early June.",
    "Her father works as a nurse at the city hospital.",
    "The little girl drew a picture of a horse and a house.",
    "The kettle is boiling, so let us have a cup of tea.",
    "The workers finished building the bridge ahead of time.",
    "He always takes the stairs instead of the elevator.",
    "We packed our bags and left early in the morning.",
    "The moon was bright enough to walk without a lamp.",
    "The baker woke up at four to start the ovens.",
    "Please send me a message when you arrive at the station.",
    "The park was full of people enjoying the warm weather.",
    "She keeps her old photographs in a wooden box.",
    "The pilot said the flight would land in twenty minutes.",
    "The soup needs a little more salt and some pepper.",
    "Our team won the game in the very last minute.",
    "The road to the village is narrow and full of turns.",
    "He borrowed a ladder to clean the gutters on the roof.",
    "The students listened carefully to the guest speaker.",
    "A gentle wind moved the leaves of the tall trees.",
    "We will meet again at the same place next week.",
]

# (synthesizer, voice, speed): espeak-ng speed in words per minute, flite a duration stretch
VOICES = [
    ("espeak-ng", "en-us", 150),
    ("flite", "slt", 1.0),
    ("espeak-ng", "en-gb", 135),
    ("flite", "rms", 1.1),
    ("espeak-ng", "en-us+f3", 165),
    ("flite", "awb", 0.95),
    ("espeak-ng", "en-gb-x-rp", 145),
]
PAUSES_S = [0.4, 0.7, 2.2, 0.5, 0.9, 1.8, 0.6, 0.45, 1.2, 0.8]  # cycled; long ones inside windows


@dataclass(frozen=True)
class ClipSpec:
    """A clip: at least ``seconds`` of speech, sentences from ``first`` on (cycling).

    ``voice`` / ``pause`` fix one voice and one pause for the whole clip, and such a clip
    keeps its natural layout (no sentence moved onto a boundary)."""

    name: str
    seconds: float
    first: int
    voice: tuple[str, str, float] | None = None
    pause: float | None = None


Voice = tuple[str, str, float]
SLT, AWB, RMS13 = ("flite", "slt", 1.0), ("flite", "awb", 0.95), ("flite", "rms", 1.3)
SLOW_F3 = ("espeak-ng", "en-us+f3", 110.0)  # a slow female espeak-ng voice
FAST_GB, FAST_RP = ("espeak-ng", "en-gb", 220.0), ("espeak-ng", "en-gb-x-rp", 250.0)
US150, US190 = ("espeak-ng", "en-us", 150.0), ("espeak-ng", "en-us", 190.0)


@dataclass(frozen=True)
class PartsSpec:
    """A clip laid out by hand: (sentence index, voice, pause after) parts from 0.3 s, then
    ``tail`` seconds of silence (the tail clips end a file with speech after a pause)."""

    name: str
    parts: tuple[tuple[int, Voice, float], ...]
    tail: float


# about 34 s of speech: the tail clips built on it end in a short second window
LEAD_34S = ((0, US150, 0.6), (1, SLT, 0.9), (2, FAST_GB, 0.5), (5, AWB, 0.8), (6, US150, 0.7),
            (8, RMS13, 1.2), (9, SLT, 0.6), (10, US190, 1.0), (13, AWB, 0.9))  # fmt: skip

CLIPS: dict[str, ClipSpec | PartsSpec] = {
    c.name: c
    for c in (
        ClipSpec("long45", 45.0, 0),
        ClipSpec("long90", 90.0, 12),
        ClipSpec("long180", 180.0, 5),
        # one flite voice, even pauses: the clip whose 6th sentence (just after the first
        # window's last segment) the loop without previous-text prompts dropped
        ClipSpec("slt40", 40.0, 0, ("flite", "slt", 1.0), 0.5),
        # the last sentence in the last 2-8 s, after a pause that ends a segment, in a window
        # shorter than 30 s (the window whose padding once made tiny.en stop after its first
        # segment and lose the rest)
        PartsSpec("tail_slow", ((4, SLT, 1.0), (35, SLOW_F3, 0.0)), 0.3),
        PartsSpec("tail_fast", ((4, SLT, 1.0), (22, FAST_GB, 0.0)), 0.5),
        PartsSpec("tail_late", ((3, US150, 0.8), (35, FAST_RP, 0.0)), 0.8),
        PartsSpec("tail_long", (*LEAD_34S, (35, SLOW_F3, 0.0)), 0.3),
        PartsSpec("tail_long_silence", (*LEAD_34S, (35, SLOW_F3, 0.0)), 2.5),
    )
}


@dataclass(frozen=True)
class Spoken:
    """One sentence as placed in a clip."""

    text: str
    voice: str
    start: float
    end: float


def synthesize(text: str, voice: tuple[str, str, float], tmp: Path) -> np.ndarray:
    """16 kHz mono float32 samples of ``text`` spoken by ``voice``."""
    from kvcache.audio.io import load_audio

    tool, name, speed = voice
    wav = tmp / "sentence.wav"
    if tool == "espeak-ng":
        cmd = ["espeak-ng", "-v", name, "-s", str(int(speed)), "-w", str(wav), text]
    else:
        cmd = ["flite", "-voice", name, "--setf", f"duration_stretch={speed}", "-t", text]
        cmd += ["-o", str(wav)]
    subprocess.run(cmd, check=True, capture_output=True)
    audio = load_audio(wav)
    return (0.5 / max(1e-6, float(np.abs(audio).max())) * audio).astype(np.float32)


def _crossing_start(start: float, dur: float, pause: float) -> float:
    """Delay a sentence so that no 30 s boundary falls near its end or in the next pause."""
    end = start + dur
    b = BOUNDARY_S * np.ceil((end - EDGE_S) / BOUNDARY_S)  # first boundary at or after end-edge
    if b <= end + pause + EDGE_S:
        return max(start, float(b) - dur / 2)  # the boundary now cuts the sentence in half
    return start


def layout(spec: ClipSpec, duration: Callable[[int], float]) -> list[tuple[int, float]]:
    """(sentence index, start second) of each sentence of a clip."""
    out: list[tuple[int, float]] = []
    t, i = (0.3, 0) if spec.pause is None else (0.0, 0)
    while not out or t < spec.seconds - 1.0:
        k = (spec.first + i) % len(SENTENCES)
        dur = duration(k)
        pause = PAUSES_S[i % len(PAUSES_S)] if spec.pause is None else spec.pause
        if spec.pause is None:
            t = _crossing_start(t, dur, pause)
        out.append((k, t))
        t += dur + pause
        i += 1
        assert i <= len(SENTENCES), f"clip {spec.name} needs more than {len(SENTENCES)} sentences"
    return out


def parts_layout(spec: PartsSpec, duration: Callable[[int], float]) -> list[tuple[int, float]]:
    """(sentence index, start second) of each part of a hand-made clip."""
    out, t = [], 0.3
    for k, _, pause in spec.parts:
        out.append((k, t))
        t += duration(k) + pause
    return out


def make_clip(spec: ClipSpec | PartsSpec, out_dir: Path) -> list[Spoken]:
    """Write ``spec.name``.wav and .json into ``out_dir``; the sentences as spoken."""
    if isinstance(spec, PartsSpec):
        voices: list[Voice] = [VOICES[0]] * len(SENTENCES)
        for k, voice, _ in spec.parts:
            voices[k] = voice
        tail = spec.tail
    else:
        voices = [spec.voice or VOICES[k % len(VOICES)] for k in range(len(SENTENCES))]
        tail = TAIL_S
    audio: dict[int, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:

        def duration(k: int) -> float:
            if k not in audio:
                audio[k] = synthesize(SENTENCES[k], voices[k], Path(tmp))
            return len(audio[k]) / RATE

        placed = (
            parts_layout(spec, duration) if isinstance(spec, PartsSpec) else layout(spec, duration)
        )
    k_last, t_last = placed[-1]
    total = int(round((t_last + duration(k_last) + tail) * RATE))
    clip = np.zeros(total, dtype=np.float32)
    spoken = []
    for k, start in placed:
        i = int(round(start * RATE))
        clip[i : i + len(audio[k])] = audio[k]
        voice = "{}:{}:{}".format(*voices[k])
        spoken.append(Spoken(SENTENCES[k], voice, i / RATE, (i + len(audio[k])) / RATE))
    soundfile.write(out_dir / f"{spec.name}.wav", clip, RATE, subtype="PCM_16")
    meta = {"seconds": total / RATE, "sentences": [asdict(s) for s in spoken]}
    (out_dir / f"{spec.name}.json").write_text(json.dumps(meta, indent=1) + "\n")
    return spoken


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--clips", nargs="+", choices=sorted(CLIPS), default=sorted(CLIPS))
    args = parser.parse_args()
    for tool in ("espeak-ng", "flite"):
        if shutil.which(tool) is None:
            print(f"{tool} not found: apt-get install -y espeak-ng flite", file=sys.stderr)
            return 1
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name in args.clips:
        spoken = make_clip(CLIPS[name], args.out_dir)
        print(f"[clips] {name}: {len(spoken)} sentences, {spoken[-1].end:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
