"""What an image carries: everything needed to make it again, in the form other tools read.

Two records, the same for an image from ``generate --prompt`` and from a batch run:

- ``parameters``: AUTOMATIC1111's text (the prompt, ``Negative prompt: ...``, then ``Steps: 20,
  Sampler: Euler a, CFG scale: 7.5, Seed: 1, Size: 512x512, Model: ...``), which AUTOMATIC1111,
  ComfyUI's and Civitai's readers, and most image browsers show;
- ``sd-kernels``: a JSON object with every setting typed (prompt, negative, seed, steps, guidance,
  scheduler, width, height, model, weights, LoRAs with their SHA-256, task, initial image and mask with
  their SHA-256, strength, dtype, precision, profile, the patch's set-up, the one-image split and its
  process count, device, version).

PNG holds both as text chunks. JPEG and WebP hold ``parameters`` in the EXIF UserComment (where
AUTOMATIC1111 puts it) and ``sd-kernels`` in an XMP packet. Other formats cannot carry them and
are refused before any work (``check_format``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import re
from typing import Any
from xml.sax.saxutils import escape, unescape

FORMATS = {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG", ".webp": "WEBP"}
QUALITY = 95  # JPEG and WebP (lossy): Pillow's 75 shows blocks in smooth gradients
KEY = "sd-kernels"
_USER_COMMENT = 0x9286  # EXIF UserComment, in the Exif IFD (0x8769)
_EXIF_IFD = 0x8769
_UNICODE = b"UNICODE\x00"  # EXIF's character-code prefix for UTF-16 text
_XMP_NS = "urn:sd-kernels:metadata:1"
_XMP = ('<?xpacket begin="\ufeff" id="W5M0MpCehiHzreSzNTczkc9d"?><x:xmpmeta xmlns:x="adobe:ns:meta/">'
        '<rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#"><rdf:Description rdf:about="" '
        f'xmlns:sdk="{_XMP_NS}"><sdk:settings>{{}}</sdk:settings></rdf:Description></rdf:RDF></x:xmpmeta>'
        '<?xpacket end="w"?>')


def check_format(path: str | os.PathLike, option: str = "--out") -> str:
    """The Pillow format for ``path``'s suffix; a ValueError naming ``option`` for one that cannot carry
    the metadata."""
    suffix = pathlib.Path(path).suffix.lower()
    if suffix not in FORMATS:
        what = f"a {suffix} file cannot carry the generation settings" if suffix else "no file type (suffix)"
        raise ValueError(f"{option} {path}: {what}; write {', '.join(FORMATS)}")
    return FORMATS[suffix]


def check_output(path: str | os.PathLike, records: bool = True) -> None:
    """Refuse, before any work, an --out file that could not be written at the end: a folder, a suffix
    that cannot carry the records (``records``) or that Pillow cannot write, a parent that is a file or
    not writable."""
    path = pathlib.Path(path)
    if path.is_dir():
        raise ValueError(f"--out {path}: is a folder; give a file name such as {path / 'image.png'}")
    if records:
        check_format(path)
    else:
        from PIL import Image

        if path.suffix.lower() not in Image.registered_extensions():
            raise ValueError(f"--out {path}: unknown image file extension {path.suffix!r} (use .png)")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"--out {path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"--out {path}: {parent} is not writable")


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _quote(value: Any) -> str:
    """AUTOMATIC1111's quoting of a value in the ``Key: value, ...`` line."""
    text = str(value)
    return json.dumps(text, ensure_ascii=False) if any(c in text for c in ',:\n"') else text


def parameters_text(fields: dict[str, Any]) -> str:
    """``fields`` (see the module docstring) as AUTOMATIC1111's ``parameters`` text."""
    lines = [fields["prompt"]]
    if fields.get("negative"):
        lines.append(f"Negative prompt: {fields['negative']}")
    items = {"Steps": fields["steps"], "Sampler": fields["sampler"], "CFG scale": f"{fields['guidance']:g}",
             "Seed": fields["seed"], "Size": f"{fields['width']}x{fields['height']}", "Model": fields["model"]}
    if fields.get("precision", "fp16") != "fp16":  # the lossy tier; the lossless default goes unsaid
        items["Precision"] = fields["precision"]
    if fields.get("strength") is not None:
        items["Denoising strength"] = f"{fields['strength']:g}"
    if fields.get("loras"):
        items["Lora hashes"] = ", ".join(f"{pathlib.Path(x['path']).stem}: {x['sha256'][:12]}" for x in fields["loras"])
    items["Version"] = f"sd-kernels {fields['version']}"
    lines.append(", ".join(f"{k}: {_quote(v)}" for k, v in items.items()))
    return "\n".join(lines)


def records(fields: dict[str, Any]) -> dict[str, str]:
    """The two records an image carries: ``parameters`` and ``sd-kernels`` (JSON)."""
    return {"parameters": parameters_text(fields), KEY: json.dumps(fields, ensure_ascii=False, sort_keys=True)}


def encode(image: Any, path: pathlib.Path, fields: dict[str, Any]) -> None:
    """Write ``image`` (an HxWx3 float array in [0, 1], or a PIL image) to ``path`` with its records:
    into a temporary file beside it, renamed into place when complete (removed if anything fails), so
    ``path`` is either the whole image or absent."""
    from PIL import Image

    fmt = check_format(path)
    if not isinstance(image, Image.Image):
        import numpy as np

        image = Image.fromarray((np.clip(image, 0, 1) * 255).round().astype("uint8"))
    chunks = records(fields)
    options: dict[str, Any] = {}
    if fmt == "PNG":
        from PIL.PngImagePlugin import PngInfo

        info = PngInfo()
        for key, value in chunks.items():
            info.add_text(key, value)  # tEXt where the text is Latin-1, else iTXt (UTF-8)
        options["pnginfo"] = info
    else:
        exif = Image.Exif()
        exif.get_ifd(_EXIF_IFD)[_USER_COMMENT] = _UNICODE + chunks["parameters"].encode("utf-16-be")
        options.update(exif=exif, xmp=_XMP.format(escape(chunks[KEY])).encode(), quality=QUALITY)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        image.save(tmp, format=fmt, **options)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def read(path: str | os.PathLike) -> dict[str, Any]:
    """The records of an image this module wrote: ``{"parameters": str, "sd-kernels": dict}`` (a record
    that is missing is absent)."""
    from PIL import Image

    out: dict[str, Any] = {}
    with Image.open(path) as im:
        if im.format == "PNG":
            text = dict(im.text)
            params, ours = text.get("parameters"), text.get(KEY)
        else:
            comment = im.getexif().get_ifd(_EXIF_IFD).get(_USER_COMMENT)
            params = comment[len(_UNICODE):].decode("utf-16-be") if isinstance(comment, bytes) and comment.startswith(
                _UNICODE) else None
            xmp = im.info.get("xmp", b"")
            xmp = xmp.decode("utf-8", "replace") if isinstance(xmp, bytes) else xmp
            found = re.search(r"<sdk:settings>(.*?)</sdk:settings>", xmp, re.S)
            ours = unescape(found.group(1)) if found else None
    if params is not None:
        out["parameters"] = params
    if ours is not None:
        out[KEY] = json.loads(ours)
    return out
