"""The bundled model pair's training text: English technical prose that Debian ships as documentation.

`linux-doc-6.1` puts the kernel's reStructuredText sources under html/_sources/ (about 32 MB) and
`python3.11-doc` the Python manual's as .rst.txt (about 12 MB); both install with
`apt-get install --no-install-recommends linux-doc-6.1 python3.11-doc`. A document is one file; the
train/validation split hashes each document's path, so it is the same on every machine and a document
never straddles the split.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

DEBIAN_DOC_DIRS = ("/usr/share/doc/linux-doc-6.1/html/_sources", "/usr/share/doc/python3.11/html/_sources")
# Heading underlines and transitions ("=====", "-----", "~~~~"): markup, not prose; left in they would
# be the most predictable tokens of the corpus and flatter both perplexity and acceptance.
RULE_LINE = re.compile(r"^[ \t]*([=\-~^*#+`.:'\"_])\1{3,}[ \t]*(\n|$)", re.MULTILINE)
BLANK_RUNS = re.compile(r"\n{3,}")


@dataclass
class Document:
    path: str  # relative to its source folder, the key of the split
    text: str


def clean(text: str) -> str:
    return BLANK_RUNS.sub("\n\n", RULE_LINE.sub("", text)).strip()


def is_validation(path: str, val_percent: int) -> bool:
    return int(hashlib.sha256(path.encode()).hexdigest(), 16) % 100 < val_percent


def read_documents(dirs: tuple[str, ...] | list[str] = DEBIAN_DOC_DIRS) -> list[Document]:
    """Every .txt file under the folders, cleaned, in a fixed order. Raises with the install command
    when a folder is missing."""
    docs = []
    for root in map(Path, dirs):
        if not root.is_dir():
            raise FileNotFoundError(f"corpus folder {root} not found; install it with `apt-get install "
                                    "--no-install-recommends linux-doc-6.1 python3.11-doc` or pass --corpus")
        for path in sorted(root.rglob("*.txt")):
            text = clean(path.read_text(errors="replace"))
            if text:
                docs.append(Document(f"{root.name}:{path.relative_to(root)}", text))
    return docs


def split_documents(docs: list[Document], val_percent: int = 2) -> tuple[list[Document], list[Document]]:
    """(train, validation) by hash of each document's path."""
    train = [d for d in docs if not is_validation(d.path, val_percent)]
    val = [d for d in docs if is_validation(d.path, val_percent)]
    return train, val
