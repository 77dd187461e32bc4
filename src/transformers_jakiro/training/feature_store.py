"""Target features on disk, so that training never runs the target forward twice on the same conversation.

Training a head needs, for every conversation, the target's last hidden states (the features the draft reads and is
trained towards) and the target's greedy next tokens. Computing them is most of a training step's cost on a CPU and
the same for every epoch, every `--resume` and every later run on the same data. `FeatureStore` keeps them in
safetensors shards in one directory:

- Entries are keyed by a digest of the conversation's token ids and loss mask (`conversation_key`), not by its place
  in a data file: a run with another data mix, order or held-out split reuses whatever conversations it shares.
- New entries are buffered in memory and written as a new shard (`shard-<process>-<unique id>.safetensors`, written
  to a temporary name and renamed, so a crash never leaves half a shard) once the buffer holds `shard_bytes`, and at
  every `flush()` (the trainer flushes at each checkpoint and at the end). Several runs (or DDP ranks) can share one
  directory: shard names never collide, and a lookup that misses first picks up shards other runs have written since.
- Shards are read lazily through `safe_open`, which memory-maps the file: opening a store of many GB costs nothing.
- `store.json` records which target wrote the features (name, shape, dtype and a digest of its weights); opening the
  directory for another target is an error instead of silently training on the wrong features.

A plain `dict` is the in-memory variant (`--cache-features`); both are mappings key -> (features, next_tokens).
"""

import hashlib
import json
import os
import uuid
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def conversation_key(input_ids, loss_mask) -> str:
    """Digest of one (unpadded) conversation's token ids and loss mask: the next tokens stored with the features
    are computed only where the mask marks a trained position, so both decide the entry."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(torch.as_tensor(input_ids, dtype=torch.int64).numpy().tobytes())
    digest.update(torch.as_tensor(loss_mask, dtype=torch.bool).numpy().tobytes())
    return digest.hexdigest()


def target_fingerprint(target, feature_layers=()) -> dict:
    """What makes two targets' features interchangeable: the config's shape and the weights themselves (a digest of
    the first values of every parameter: another checkpoint of the same architecture differs there), and which
    decoder layers' outputs are stored beside the last hidden state (`feature_layers`, recorded only when some
    are: stores of last hidden states alone keep their fingerprint)."""
    digest = hashlib.blake2b(digest_size=16)
    for name, parameter in target.named_parameters():
        digest.update(name.encode())
        digest.update(parameter.detach().flatten()[:16].float().cpu().numpy().tobytes())
    config = target.config.get_text_config(decoder=True)
    return {
        "target": getattr(target.config, "_name_or_path", ""),
        "model_type": config.model_type,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "dtype": str(target.get_output_embeddings().weight.dtype).removeprefix("torch."),
        "weights": digest.hexdigest(),
    } | ({"feature_layers": list(feature_layers)} if feature_layers else {})


class FeatureStore:
    """A directory of safetensors shards: key -> (features [n, hidden], next_tokens [n]), read as CPU tensors."""

    def __init__(self, directory, fingerprint: dict, process_index: int = 0, shard_bytes: int = 256 * 2**20):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process_index = process_index
        self.shard_bytes = shard_bytes
        info = self.directory / "store.json"
        if info.is_file():
            existing = json.loads(info.read_text())
            differences = [
                f"{key}: {existing.get(key)!r} there, {fingerprint.get(key)!r} now"
                for key in sorted(set(fingerprint) | set(existing))
                if existing.get(key) != fingerprint.get(key)
            ]
            if differences:
                raise ValueError(
                    f"The feature store {self.directory} holds features of another target ({'; '.join(differences)}). "
                    "Use another --feature-cache directory, or delete this one."
                )
        elif process_index == 0:
            info.write_text(json.dumps(fingerprint, indent=2) + "\n")
        self._index = {}  # key -> the open shard that holds it
        self._opened = set()
        self._pending = {}
        self._pending_bytes = 0
        self._seen_mtime = None
        self._refresh()

    def _refresh(self) -> None:
        """Open shards written since the last look (by this store, another run or another rank)."""
        mtime = self.directory.stat().st_mtime_ns
        if mtime == self._seen_mtime:
            return
        self._seen_mtime = mtime
        for path in sorted(self.directory.glob("shard-*.safetensors")):
            if path.name not in self._opened:
                self._open(path)

    def _open(self, path: Path) -> None:
        self._opened.add(path.name)
        shard = safe_open(str(path), framework="pt", device="cpu")
        for name in shard.keys():
            key, _, kind = name.partition("/")
            if kind == "features":
                self._index[key] = shard

    def __contains__(self, key: str) -> bool:
        if key in self._pending or key in self._index:
            return True
        self._refresh()
        return key in self._index

    def __len__(self) -> int:
        return len(self._index) + len(self._pending)

    def __iter__(self):
        yield from self._index
        yield from (key for key in self._pending if key not in self._index)

    def __getitem__(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        if key in self._pending:
            return self._pending[key]
        if key not in self._index:
            self._refresh()
        shard = self._index[key]
        return shard.get_tensor(f"{key}/features"), shard.get_tensor(f"{key}/next_tokens")

    def __setitem__(self, key: str, value: tuple[torch.Tensor, torch.Tensor]) -> None:
        if key in self:
            return
        features, next_tokens = value
        self._pending[key] = (features.contiguous(), next_tokens.contiguous())
        self._pending_bytes += features.numel() * features.element_size() + next_tokens.numel() * 8
        if self._pending_bytes >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        """Write the buffered entries as a new shard (atomically: a temporary file renamed into place)."""
        if not self._pending:
            return
        path = self.directory / f"shard-{self.process_index}-{uuid.uuid4().hex[:12]}.safetensors"
        tensors = {}
        for key, (features, next_tokens) in self._pending.items():
            tensors[f"{key}/features"] = features
            tensors[f"{key}/next_tokens"] = next_tokens
        temporary = path.with_suffix(".tmp")
        save_file(tensors, str(temporary))
        os.replace(temporary, path)
        self._pending, self._pending_bytes = {}, 0
        self._open(path)

    def size_bytes(self) -> int:
        return sum(path.stat().st_size for path in self.directory.glob("shard-*.safetensors"))


__all__ = ["FeatureStore", "conversation_key", "target_fingerprint"]
