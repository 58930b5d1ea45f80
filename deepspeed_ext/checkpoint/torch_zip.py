"""What a ``torch.save`` zip archive is made of: the names of its records (part of the torch fence, with
:mod:`.zipsave`, which writes these archives through torch's private writer and checks that writer up front).

``torch.save`` writes one zip archive ``<archive>/``: the pickle ``<archive>/data.pkl``, one record per tensor
storage ``<archive>/data/<key>`` (its bytes, 64-byte aligned), and small records beside them (``byteorder``,
``version``, ``.data/serialization_id``). Everything in deepspeed-ext that knows these names imports them from
here.
"""

from __future__ import annotations

#: The record that identifies one save (torch >= 2.2); zipsave writes it last, as torch does.
ID_RECORD = ".data/serialization_id"


def is_storage_record(name: str) -> bool:
    """Whether the torch zip record ``name`` holds a tensor storage (``<archive>/data/<key>``)."""
    return "/data/" in name and name.rsplit("/", 1)[-1].isdigit()
