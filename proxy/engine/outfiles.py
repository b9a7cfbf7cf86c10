"""Cut bodies as files the agent can grep (the second seed: "большой вывод ядро кладёт файлом в <id>.out/ и
дописывает в результат [полный вывод: …]").

An agent that has no ``read_overflow`` — a text-protocol agent the tools were never offered to, an operator who
switched the tools off — can still get a cut body back with its own tools when ``overflow_dir`` is set (for an
agent on the same machine, e.g. a folder in its workspace): every body cut into the overflow store is also
written there as ``<id>.out``, and its stub names the file (``[full output: <path>]``, decided in the core from the
same setting). The files are written right after the bodies are journaled, before the projection that names them
is forwarded. Content-addressed like the store: a file that exists already holds the same bytes. Incognito
sessions never write here (their rules carry no ``overflow_dir``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from ctxproxy.config import Settings

__all__ = ["outfiles_dir", "write_outfiles"]

log = logging.getLogger("ctxproxy")


def outfiles_dir(settings: Settings, incognito: bool) -> str:
    """The folder the stubs name ("" when off or incognito): absolute, since the agent may run elsewhere."""
    if not settings.overflow_dir or incognito:
        return ""
    return str(Path(settings.overflow_dir).expanduser().absolute())


async def write_outfiles(folder: str, bodies: Sequence[tuple[str, str]]) -> None:
    """Write each ``(overflow_id, body)`` as ``<folder>/<id>.out`` off the event loop."""
    if folder and bodies:
        await asyncio.to_thread(_write, Path(folder), list(bodies))


def _write(folder: Path, bodies: list[tuple[str, str]]) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for overflow_id, body in dict(bodies).items():
            target = folder / f"{overflow_id}.out"
            if target.exists():
                continue
            partial = folder / f".{overflow_id}.out.partial"
            partial.write_text(body, encoding="utf-8")
            os.replace(partial, target)  # a reader never sees half a file
    except OSError as exc:  # the store holds the body: read_overflow still restores it
        log.error("could not write cut bodies to overflow_dir %s (%s); read_overflow still restores them. "
                  "Check the folder exists and is writable.", folder, exc)
