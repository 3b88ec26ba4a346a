#!/usr/bin/env bash
# Regenerate the speech fixtures of tests/fixtures/audio/ from sentences.json with espeak-ng.
# Each WAV is 16 kHz mono 16-bit PCM, voice en-us at 120 words/min (espeak-ng writes 22.05 kHz;
# we resample with scipy).
# Usage: bash scripts/make_audio_fixtures.sh    (needs: apt-get install -y espeak-ng; .venv)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="$root/tests/fixtures/audio"
py="$root/.venv/bin/python"
command -v espeak-ng >/dev/null 2>&1 || { echo "espeak-ng not found: apt-get install -y espeak-ng" >&2; exit 1; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$py" - "$dir/sentences.json" <<'PY' > "$tmp/list.tsv"
import json, sys
for name, text in json.load(open(sys.argv[1])).items():
    print(f"{name}\t{text}")
PY
while IFS=$'\t' read -r name text; do
  espeak-ng -v en-us -s 120 -w "$tmp/$name" "$text"
  "$py" - "$tmp/$name" "$dir/$name" <<'PY'
import sys
from math import gcd

import numpy as np
import soundfile
from scipy.signal import resample_poly

audio, rate = soundfile.read(sys.argv[1], dtype="float32", always_2d=True)
audio = audio.mean(axis=1)
g = gcd(rate, 16000)
audio = resample_poly(audio, 16000 // g, rate // g)
soundfile.write(sys.argv[2], np.clip(audio, -1, 1), 16000, subtype="PCM_16")
PY
  echo "[fixtures] $name: $text"
done < "$tmp/list.tsv"
