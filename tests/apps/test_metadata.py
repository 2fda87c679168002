"""What an image carries (sd_kernels/apps/metadata.py): AUTOMATIC1111's ``parameters`` text and our JSON
record, in PNG, JPEG and WebP, read back with Pillow alone; other formats refused; a failed write
leaves neither a partial image nor a temporary file."""

import json
import re

import numpy as np
import pytest
from PIL import ExifTags, Image

from sd_kernels.apps import metadata

FIELDS = {"prompt": "a café, at night: \"neon\"", "negative": "blur, 低画質", "seed": 2**63 + 5, "steps": 20,
          "guidance": 7.5, "width": 64, "height": 48, "scheduler": "dpm++2m-karras", "sampler": "DPM++ 2M Karras",
          "model": "models/my, model.safetensors", "config": "sd15", "weights": "loaded from models/my, model",
          "pipeline": "StableDiffusionPipeline", "loras": [{"path": "/l/detail.safetensors", "scale": 0.6,
                                                             "sha256": "ab" * 32}],
          "image": None, "mask": None, "strength": None, "dtype": "fp16", "profile": "hopper",
          "setup": "patch(profile='hopper', cuda_graph='pipeline', compile=False)", "device": "cuda:0 (H100)",
          "version": "0.1.0"}


def _a1111(text: str) -> tuple[str, str, dict[str, str]]:
    """AUTOMATIC1111's own reading of ``parameters``: prompt lines, the negative prompt, then the last
    line's ``Key: value`` pairs (a value with a comma or colon is JSON-quoted)."""
    *head, last = text.split("\n")
    prompt, negative = [], []
    for line in head:
        (negative if line.startswith("Negative prompt: ") or negative else prompt).append(line)
    pairs = {k: json.loads(v) if v.startswith('"') else v
             for k, v in re.findall(r'\s*([\w ]+): ("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)', last)}
    return "\n".join(prompt), "\n".join(negative).removeprefix("Negative prompt: "), pairs


@pytest.mark.parametrize("suffix", [".png", ".jpg", ".jpeg", ".webp"])
def test_records_round_trip_through_pillow(tmp_path, suffix):
    path = tmp_path / f"image{suffix}"
    rng = np.random.default_rng(0)
    metadata.encode(rng.random((48, 64, 3)), path, FIELDS)
    with Image.open(path) as im:  # Pillow alone, as another tool would read it
        assert im.size == (64, 48)
        if suffix == ".png":
            params, ours = im.text["parameters"], json.loads(im.text["sd-kernels"])
        else:
            comment = im.getexif().get_ifd(ExifTags.IFD.Exif)[ExifTags.Base.UserComment]
            assert comment.startswith(b"UNICODE\x00")
            params = comment[8:].decode("utf-16-be")
            ours = metadata.read(path)["sd-kernels"]
            assert b"urn:sd-kernels:metadata:1" in im.info["xmp"]
    assert ours == FIELDS and metadata.read(path) == {"parameters": params, "sd-kernels": FIELDS}
    prompt, negative, pairs = _a1111(params)
    assert (prompt, negative) == (FIELDS["prompt"], FIELDS["negative"])
    assert pairs == {"Steps": "20", "Sampler": "DPM++ 2M Karras", "CFG scale": "7.5", "Seed": str(2**63 + 5),
                     "Size": "64x48", "Model": "models/my, model.safetensors",
                     "Lora hashes": "detail: abababababab", "Version": "sd-kernels 0.1.0"}
    assert not list(tmp_path.glob(".*"))


def test_the_same_keys_for_every_image():
    assert set(metadata.records(FIELDS)) == {"parameters", "sd-kernels"}
    plain = {**FIELDS, "negative": None, "loras": [], "strength": 0.75}
    _, negative, pairs = _a1111(metadata.parameters_text(plain))
    assert negative == "" and "Lora hashes" not in pairs and pairs["Denoising strength"] == "0.75"


@pytest.mark.parametrize("name, why", [("x.bmp", "a .bmp file cannot carry the generation settings"),
                                       ("x.gif", "a .gif file cannot"), ("x.tiff", "a .tiff file cannot"),
                                       ("x", "no file type \\(suffix\\)")])
def test_formats_that_cannot_carry_the_records_are_refused(tmp_path, name, why):
    with pytest.raises(ValueError, match=f"{why}.*; write .png, .jpg, .jpeg, .webp"):
        metadata.check_format(tmp_path / name)


def test_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    def broken(self, fp, format=None, **params):
        with open(fp, "wb") as f:
            f.write(b"\x89PNG half an image")
        raise OSError("No space left on device")

    monkeypatch.setattr(Image.Image, "save", broken)
    with pytest.raises(OSError, match="No space left"):
        metadata.encode(np.zeros((8, 8, 3)), tmp_path / "00000.png", FIELDS)
    assert list(tmp_path.iterdir()) == []
