"""`serve --record DIR`: keep every finished reply's prompt and token ids, to fine-tune the
drafter on the traffic it serves (`dflash-mlx train finetune --from DIR`).

Off unless asked: the records hold the conversations themselves (as token ids, which the
tokenizer turns back into text). They go to `DIR/replies.jsonl`, one JSON line per reply,
in the training data's record format (`train.data.read_records`): `ids` = prompt + reply,
the reply from `start`. Each line is written whole in one call and flushed, so a server
stopped at any moment leaves at most a torn last line, which the reader drops and the
next server cuts before it appends.
`DIR/meta.json` says which target wrote them: token ids mean nothing to another tokenizer.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

from ..train.data import end_at_a_record

RECORDS = "replies.jsonl"
META = "meta.json"


class Recorder:
    """Appends finished replies to `directory`/replies.jsonl (made if missing)."""

    def __init__(self, directory: Path, target: str, vocab_size: int):
        self.directory = Path(directory).expanduser()
        self.directory.mkdir(parents=True, exist_ok=True)
        meta = self.directory / META
        if meta.exists():
            stored = json.loads(meta.read_text())
            if stored.get("vocab_size") != vocab_size:
                raise ValueError(
                    f"{self.directory} holds replies of a target with a vocabulary of "
                    f"{stored.get('vocab_size')} tokens ({stored.get('target')}), not "
                    f"{vocab_size}: record into another directory"
                )
        else:
            meta.write_text(json.dumps({"target": target, "vocab_size": vocab_size}) + "\n")
        self.path = self.directory / RECORDS
        end_at_a_record(self.path)  # a server killed mid-line left a torn one
        self.session = uuid.uuid4().hex[:8]
        self.count = 0

    def add(self, prompt: list[int], reply: list[int], finish_reason: str | None) -> None:
        """One finished reply (a reply with no token is not worth a line)."""
        if not reply:
            return
        self.count += 1
        record = {
            "id": f"recorded-{self.session}-{self.count:06d}",
            "category": "recorded",
            "ids": [*prompt, *reply],
            "start": len(prompt),
            "finish_reason": finish_reason,
            "time": round(time.time(), 3),
        }
        line = (json.dumps(record) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
