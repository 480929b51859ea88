"""The conductor's KV index: which instance holds which block, in which tier.

Fed by two kinds of event streams, both in vLLM's KV-event wire format:

- **engine events** (one stream per vLLM instance): blocks entering and leaving that instance's
  own device cache. vLLM names blocks by its own hashes, which are not reproducible across
  processes, so each ``BlockStored`` is translated to Baton's chain keys from its tokens and its
  parent (``kvstore.keys.hash_block``); the per-instance map from vLLM hash to Baton key resolves
  later ``BlockRemoved`` events and parents.
- **store events** (one stream per store node): blocks entering and leaving the node's host
  (``CPU``) and disk (``DISK``) tiers, already named by Baton keys. Every instance on a node can
  load what the node's store holds, so a store hit counts for each of them.

Holders are bitmasks (one bit per instance, one per node), so matching a 64-block prompt against
a thousand instances is a few dozen integer ANDs. The tiers are ``KeyTable``s and engine blocks
are keyed straight from their raw msgpack tokens, both in C (``conductor/_kvtable.c``): a
million-key dict of ``bytes`` costs three dependent cache misses per lookup, and decoding and
hashing tokens in Python cost most of the ingestion time. ``prefix_hits`` returns, per instance, the
leading run of the prompt's blocks it can reach and in which tier (``conductor.policy.PrefixHit``);
``prefix_run_groups`` returns the same grouped by run (with a system prompt on every instance,
nearly every holder has the same run, and pricing handles each run once).

Segmented salts (a ``cache_salt`` from a token offset on, ``kvstore.keys``): the two streams key
the same prompt differently, and each says what its tier can really share. vLLM salts its own
prefix cache from the first block (it cannot salt from an offset), so an engine's device blocks
are keyed here with the whole-prompt salt (``_cache_salt`` of the chain's first block): a
request's segmented keys match another salt's device blocks nowhere, which is the truth (that
engine would recompute them). The store keys blocks by the requests' segmented keys, so its
host and disk entries share the unsalted trunk across salts: a tenant's request matches another
tenant's trunk there, loaded from the store's host tier, and nothing after the offset.

Never trusting a stale entry: every stream carries sequence numbers; a gap (lost events) or a
restart (sequence back to 0, ``AllBlocksCleared``) makes ``ingest_*`` return ``StreamGap`` and the
caller replays or calls ``clear_instance`` / ``clear_node`` to drop what the stream said, so the
index under-reports until the stream has re-announced (a lost affinity, never a wrong hit). The
index itself does no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import repeat
from typing import Iterable, Sequence

import msgspec

from conductor._kvtable import KeyTable, chain_keys_msgpack, prefix_groups, prefix_runs
from conductor.policy import PrefixHit
from kvstore.events import MEDIUM_DISK, MEDIUM_HOST, AllBlocksCleared, BlockRemoved, BlockStored
from kvstore.keys import BlockKey, KeyExtras, chain_keys, root_key


MAX_SHARED_MASKS = 1 << 16


class _RawBlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    """``kvstore.events.BlockStored`` as the index decodes it: the token ids stay raw msgpack,
    parsed and chain-hashed in C (``chain_keys_msgpack``) without becoming Python ints."""

    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: msgspec.Raw
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[list | None] | None = None


class _RawEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """``kvstore.events.KVEventBatch`` with ``_RawBlockStored`` events."""

    ts: float
    events: list[_RawBlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_STORED = (BlockStored, _RawBlockStored)


def _event_keys(parent: BlockKey, event: BlockStored | _RawBlockStored) -> list[BlockKey]:
    """The chain keys of a stored event's full blocks; ``ValueError`` if a token id is not a
    uint32. Raw tokens (from ``ingest_engine``) are parsed and hashed in C; a list (events built
    in Python, as the simulator's) goes through ``kvstore.keys.chain_keys``: the same keys."""
    if isinstance(event.token_ids, msgspec.Raw):
        return chain_keys_msgpack(parent, event.token_ids, event.block_size)
    return chain_keys(parent, event.token_ids, event.block_size)


class RunGroups(msgspec.Struct, frozen=True):
    """``KvIndex.prefix_hits`` grouped by run: ``runs`` are the distinct leading runs (each of
    at least one block), ``bits`` the holders' instance bits in ascending order and ``run_of``
    the index in ``runs`` of each holder's run (both int64 ``memoryview``s). An instance's bit
    is ``KvIndex.bit_of``."""

    runs: tuple[PrefixHit, ...]
    bits: memoryview
    run_of: memoryview


NO_RUNS = RunGroups((), memoryview(b"").cast("q"), memoryview(b"").cast("q"))
"""The groups of a prompt no instance holds."""


class StreamGap(msgspec.Struct, frozen=True):
    """Events were lost on a stream: ``expected_seq`` was due, ``got_seq`` arrived."""

    source: str
    expected_seq: int
    got_seq: int


@dataclass
class _Instance:
    bit: int
    node_id: str
    model_id: str
    kv_layout: str
    last_seq: int | None = None
    vllm_to_key: dict = field(default_factory=dict)
    """vLLM block hash → Baton key, for every block the instance's stream said it holds."""
    noted: set = field(default_factory=set)
    """Keys recorded by ``note_device_blocks`` (known held, not yet from the stream)."""


@dataclass
class _Node:
    bit: int
    last_seq: int | None = None
    host_keys: set = field(default_factory=set)
    disk_keys: set = field(default_factory=set)


def _bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _cache_salt(extra_keys: list | None, has_lora: bool) -> str:
    """The ``cache_salt`` in vLLM's untagged extra keys of a chain's first block ('' if none)."""
    if not extra_keys or extra_keys[0] is None:
        return ""
    strings = [k for k in extra_keys[0] if isinstance(k, str)]
    if has_lora and strings:
        strings = strings[1:]
    return strings[-1] if strings else ""


class KvIndex:
    """Block holders by tier. Not thread-safe: one owner (the conductor's event loop) calls it."""

    def __init__(self) -> None:
        self._instances: dict[str, _Instance] = {}
        self._nodes: dict[str, _Node] = {}
        self._instance_ids: dict[int, str] = {}
        self._device = KeyTable()
        self._host = KeyTable()
        self._disk = KeyTable()
        self._node_members: dict[int, int] = {}
        """node bit → mask of the instances on it."""
        self._members_of_mask: dict[int, int] = {0: 0}
        """Memo: node mask → mask of every instance on those nodes."""
        self._masks: dict[int, int] = {}
        """Every holder mask in use, once: the tiers' values point here, so a million entries
        share a few thousand int objects (less memory, and a hot object per lookup)."""
        self._decoder = msgspec.msgpack.Decoder(_RawEventBatch)
        self.num_untranslatable_blocks = 0
        """Blocks announced with a parent the index never saw (their chain cannot be keyed)."""
        self.num_resyncs = 0
        self.num_duplicates = 0

    # ------------------------------------------------------------------ membership

    def add_instance(self, instance_id: str, node_id: str, model_id: str, kv_layout: str) -> None:
        """Start tracking an instance (idempotent; re-adding clears what it held)."""
        if instance_id in self._instances:
            self.remove_instance(instance_id)
        used = {i.bit for i in self._instances.values()}
        bit = next(b for b in range(len(used) + 1) if b not in used)
        # A new engine's stream starts at 0: even the loss of its first batch is a gap.
        self._instances[instance_id] = _Instance(bit, node_id, model_id, kv_layout, last_seq=-1)
        self._instance_ids[bit] = instance_id
        node = self._node(node_id)
        self._node_members[node.bit] = self._node_members.get(node.bit, 0) | (1 << bit)
        self._members_of_mask = {0: 0}

    def remove_instance(self, instance_id: str) -> None:
        """Forget an instance that left: its device entries go with it."""
        inst = self._instances.get(instance_id)
        if inst is None:
            return
        self.clear_instance(instance_id)
        node = self._nodes[inst.node_id]
        self._node_members[node.bit] &= ~(1 << inst.bit)
        del self._instances[instance_id], self._instance_ids[inst.bit]
        self._members_of_mask = {0: 0}

    def add_node(self, node_id: str) -> None:
        """Start tracking a store node whose stream starts now (at sequence 0)."""
        self._node(node_id).last_seq = -1

    def _node(self, node_id: str) -> _Node:
        node = self._nodes.get(node_id)
        if node is None:
            used = {n.bit for n in self._nodes.values()}
            node = _Node(next(b for b in range(len(used) + 1) if b not in used))
            self._nodes[node_id] = node
        return node

    def clear_instance(self, instance_id: str) -> None:
        """Drop every device entry of an instance (its stream restarted or lost events)."""
        inst = self._instances[instance_id]
        keep = ~(1 << inst.bit)
        self._device.and_keep(inst.vllm_to_key.values(), keep, self._masks)
        self._device.and_keep(inst.noted, keep, self._masks)
        inst.vllm_to_key.clear()
        inst.noted.clear()
        inst.last_seq = None
        self.num_resyncs += 1

    def clear_node(self, node_id: str) -> None:
        """Drop every host and disk entry of a store node (lost, restarted, or out of sync)."""
        node = self._node(node_id)
        keep = ~(1 << node.bit)
        self._host.and_keep(node.host_keys, keep, self._masks)
        self._disk.and_keep(node.disk_keys, keep, self._masks)
        node.host_keys.clear()
        node.disk_keys.clear()
        node.last_seq = None
        self.num_resyncs += 1

    # ------------------------------------------------------------------ ingestion

    def _check_seq(self, source: str, last_seq: int | None, seq: int) -> StreamGap | bool | None:
        """None: apply; True: a duplicate (already applied, e.g. after a replay), skip it;
        a ``StreamGap``: batches were lost. A stream that starts over at 0 is a restarted
        publisher: what it said before is dropped and the batch applies."""
        if last_seq is None or seq == last_seq + 1:
            return None
        if seq == 0:
            if source in self._instances:
                self.clear_instance(source)
            else:
                self.clear_node(source)
            return None
        if seq <= last_seq:
            self.num_duplicates += 1
            return True
        return StreamGap(source, last_seq + 1, seq)

    def ingest_engine(self, instance_id: str, seq: int, payload: bytes) -> StreamGap | None:
        """Apply one engine batch (msgpack ``KVEventBatch``); a gap is returned, not applied."""
        inst = self._instances.get(instance_id)
        if inst is None:
            return None  # an instance that left (or was never registered): nothing to trust
        gap = self._check_seq(instance_id, inst.last_seq, seq)
        if gap is True:
            return None
        if gap is not None:
            return gap
        inst.last_seq = seq
        self._bound_masks()
        self.apply_engine_events(instance_id, self._decoder.decode(payload).events)
        return None

    def _bound_masks(self) -> None:
        """Forget the shared masks when there are too many distinct ones (entries keep theirs;
        only later ones stop sharing with them)."""
        if len(self._masks) > MAX_SHARED_MASKS:
            self._masks.clear()

    def apply_engine_events(self, instance_id: str, events: Sequence) -> None:
        inst = self._instances[instance_id]
        bit = 1 << inst.bit
        device, mapping = self._device, inst.vllm_to_key
        for event in events:
            if isinstance(event, _STORED):
                if event.parent_block_hash is None:
                    salt = _cache_salt(event.extra_keys, event.lora_name is not None)
                    parent = root_key(KeyExtras(inst.model_id, salt, event.lora_name or "",
                                                inst.kv_layout))
                else:
                    parent = mapping.get(event.parent_block_hash)
                    if parent is None:
                        self.num_untranslatable_blocks += len(event.block_hashes)
                        continue
                try:
                    keys = _event_keys(parent, event)
                except ValueError:  # token ids that are not uint32: nothing to key them by
                    self.num_untranslatable_blocks += len(event.block_hashes)
                    continue
                mapping.update(zip(event.block_hashes, keys))
                device.or_bit(keys, bit, self._masks)
            elif isinstance(event, BlockRemoved):
                gone = [k for k in map(mapping.pop, event.block_hashes, repeat(None)) if k is not None]
                device.and_keep(gone, ~bit, self._masks)
            elif isinstance(event, AllBlocksCleared):
                self.clear_instance(instance_id)
                self.num_resyncs -= 1  # a clean restart announced by the engine, not a repair

    def ingest_store(self, node_id: str, seq: int, payload: bytes) -> StreamGap | None:
        """Apply one store-node batch; a gap is returned, not applied."""
        node = self._node(node_id)
        gap = self._check_seq(node_id, node.last_seq, seq)
        if gap is True:
            return None
        if gap is not None:
            return gap
        node.last_seq = seq
        self._bound_masks()
        self.apply_store_events(node_id, self._decoder.decode(payload).events)
        return None

    def apply_store_events(self, node_id: str, events: Sequence) -> None:
        node = self._node(node_id)
        bit = 1 << node.bit
        for event in events:
            if isinstance(event, (*_STORED, BlockRemoved)):
                tier, keys = ((self._disk, node.disk_keys) if event.medium == MEDIUM_DISK
                              else (self._host, node.host_keys))
                assert event.medium in (MEDIUM_HOST, MEDIUM_DISK), event.medium
                if isinstance(event, BlockRemoved):
                    tier.and_keep(event.block_hashes, ~bit, self._masks)
                    keys.difference_update(event.block_hashes)
                else:
                    tier.or_bit(event.block_hashes, bit, self._masks)
                    keys.update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.clear_node(node_id)
                self.num_resyncs -= 1

    def note_device_blocks(self, instance_id: str, keys: Sequence[BlockKey]) -> None:
        """Record blocks an instance is known to hold right now (it just computed them), ahead
        of its events. The event that follows is idempotent. A ``BlockRemoved`` names vLLM hashes,
        so it removes a noted block only once the stream has announced it; until then a noted
        block lives until ``forget_device_blocks`` or a reset of the instance."""
        inst = self._instances.get(instance_id)
        if inst is None:
            return
        self._device.or_bit(keys, 1 << inst.bit, self._masks)
        inst.noted.update(keys)

    def forget_device_blocks(self, instance_id: str, keys: Sequence[BlockKey]) -> None:
        """The instance turned out not to hold these (it computed what the index said it held)."""
        inst = self._instances.get(instance_id)
        if inst is None:
            return
        gone = set(keys)
        self._device.and_keep(gone, ~(1 << inst.bit), self._masks)
        inst.noted -= gone
        for vllm_hash in [h for h, k in inst.vllm_to_key.items() if k in gone]:
            del inst.vllm_to_key[vllm_hash]

    # ------------------------------------------------------------------ queries

    def _instances_on(self, node_mask: int) -> int:
        """Every instance on the nodes of ``node_mask`` (memoised; 0 for 0)."""
        members = self._members_of_mask.get(node_mask)
        if members is None:
            members = 0
            for node_bit in _bits(node_mask):
                members |= self._node_members.get(node_bit, 0)
            self._members_of_mask[node_mask] = members
        return members

    def prefix_hits(self, keys: Sequence[BlockKey]) -> dict[str, PrefixHit]:
        """Per instance with a non-empty leading run of ``keys``: its blocks by fastest tier.

        The hot path of every decision, so the walk runs in C (``prefix_runs``): with a million
        keys indexed each lookup is a cache miss, so keys are looked up in chunks whose slots are
        prefetched together (the first key alone: most new prompts miss on it), the running AND
        of reachability and the per-tier counts are word operations, and the walk stops with the
        chunk in which the last run ends. Store tiers hold node masks; ``_instances_on`` maps
        them to the instances on those nodes."""
        runs = prefix_runs(keys, self._device, self._host, self._disk, self._members_of_mask,
                           self._instances_on)
        hits: dict[str, PrefixHit] = {}
        for bit, num_device, num_host, num_disk in runs:
            instance_id = self._instance_ids.get(bit)
            if instance_id is not None:
                hits[instance_id] = PrefixHit(num_device, num_host, num_disk)
        return hits

    def prefix_run_groups(self, keys: Sequence[BlockKey]) -> RunGroups:
        """``prefix_hits(keys)`` grouped by run, without a Python object per holder: the same
        walk (``prefix_groups`` in C) hands back the distinct runs and two int64 arrays."""
        runs, bits, run_of = prefix_groups(keys, self._device, self._host, self._disk,
                                           self._members_of_mask, self._instances_on)
        if not runs:
            return NO_RUNS
        return RunGroups(tuple([PrefixHit(*run) for run in runs]), memoryview(bits).cast("q"),
                         memoryview(run_of).cast("q"))

    def node_holds(self, node_id: str, keys: Sequence[BlockKey]) -> bool:
        """Whether the store node ``node_id`` holds every one of ``keys`` in host memory or on
        disk (as its events said): what another instance on that node could load."""
        node = self._nodes.get(node_id)
        if node is None:
            return False
        host, disk = node.host_keys, node.disk_keys
        return all(key in host or key in disk for key in keys)

    def bit_of(self, instance_id: str) -> int | None:
        """The instance's bit in holder masks and ``RunGroups.bits`` (None: not tracked)."""
        inst = self._instances.get(instance_id)
        return inst.bit if inst is not None else None

    def num_blocks(self) -> dict[str, int]:
        """Indexed keys per tier (a key held by several holders counts once)."""
        return {"device": len(self._device), "host": len(self._host), "disk": len(self._disk)}

    def num_device_blocks(self, instance_id: str) -> int:
        """Blocks the instance's stream says it holds (SGLang's tree size)."""
        inst = self._instances.get(instance_id)
        return len(inst.vllm_to_key) if inst else 0

    def last_seqs(self) -> dict[str, int]:
        """Per stream (instance or node), the sequence number of the last batch applied."""
        seqs = {i: inst.last_seq for i, inst in self._instances.items()}
        seqs.update({n: node.last_seq for n, node in self._nodes.items()})
        return {source: -1 if seq is None else seq for source, seq in seqs.items()}

    def instance_ids(self) -> list[str]:
        return list(self._instances)
