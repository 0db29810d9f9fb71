"""``python -m node shell COMMAND``: an operator's view of replicated ledgers, in the spirit of
BookKeeper's shell. It talks to the metadata store (``--metadata-url`` or NODE_METADATA_URL) and,
through the client, to the nodes (with their admin token from NODE_ADMIN_TOKEN when they have one).

=====================  =========================================================================
command                what it does
=====================  =========================================================================
listnodes              every node the store knows: registered now (``nodes/``) or holding a
                       cookie (``cookies/``): id, url, zone, state, instance, registered
listledgers            every replicated ledger, in id order, with its state and last ensemble
ledgermetadata LID     one ledger's metadata (BookKeeper's field names) and its revision
readledger LID         its entries (``--from``, ``--to``; default all up to lastEntryId, or the
                       LAC of an open ledger); text: one escaped line per entry; JSON: base64
recover LID            fence and recover the ledger (a no-op on a CLOSED one); prints where it ends
deleteledger LID       delete its metadata; the replicas reclaim their copies on their own
readd NODE             before a wiped node may come back under its id: recover every ledger
                       that is not CLOSED and whose last segment names NODE, then retire the
                       node's cookie, so that its next start is a new, empty node
auditor --once         one pass of the auditor: nodes lost (unregistered longer than
                       ``--lost-node-delay``, default 600 s) or decommissioning; with
                       ``--check-ledgers`` each replica says from its index which ids of its
                       settled fragments it lacks (cheap); with ``--check-replicas`` every
                       replica's entries read and compared; writes the under-replicated
                       markers and prints the report
rereplicate LID        move what the ledger's marker names to replacements (locks the marker;
                       ``locked`` when another worker holds it; exit 0 either way)
underreplicated        the markers: ledger, nodes and why, since when, locked by whom
decommission NODE      mark the node decommissioning and print the ledgers that still name it;
                       ``--wait``: audit and re-replicate until none does (exit 0 then)
recommission NODE      remove the node's decommissioning mark (new ensembles may choose it
                       again; what was moved stays moved)
=====================  =========================================================================

Every command takes ``--json`` (one JSON document on stdout; a failure is
``{"code", "message"}``). Exit status: 0 done, 1 failed (the store or the nodes refused or did
not answer), 2 usage (bad arguments, no metadata store named).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import json
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from node.autorecovery import (
    DEFAULT_LOCK_TTL_S,
    DEFAULT_LOST_NODE_DELAY_S,
    DEFAULT_OPEN_LEDGER_GRACE_S,
)
from node.client.errors import ClientError, MetadataUrlError, error_code
from node.client.model import (
    COOKIES_PREFIX,
    LEDGERS_PREFIX,
    NODES_PREFIX,
    LedgerState,
    MetadataFormatError,
    NodeInfo,
    decode,
    node_key,
)

if TYPE_CHECKING:
    from node.client import Client

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
METADATA_URL_ENV = "NODE_METADATA_URL"
TOKEN_ENV = "NODE_ADMIN_TOKEN"  # the nodes' admin token: the shell's writes and fences send it
NONE = "-"  # a cell without a value: a node known only by its cookie, an open ledger's end
NODE_REGISTERED = "node_registered"  # readd refused: the node is alive (or its lease lingers)
_PRINTABLE = frozenset(range(0x20, 0x7F)) - {ord("\\")}
_ESCAPES = {ord("\\"): "\\\\", ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"}


class ShellFailure(Exception):
    """A command that could not do what it was asked: exit 1, ``code`` in the JSON error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class UsageError(Exception):
    """Arguments the command cannot use: exit 2."""


@dataclass
class Outcome:
    """What a command prints: ``document`` with --json, else ``lines``."""

    document: Any
    lines: list[str] = field(default_factory=list)


# --- arguments --------------------------------------------------------------------------------


def ledger_id(text: str) -> int:
    """A ledger id as typed: a non-negative decimal integer."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"a ledger id is a non-negative integer, not {text!r}")
    return int(text)


def entry_id(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an entry id is an integer, not {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"an entry id is >= 0, not {value}")
    return value


def _common(parser: argparse.ArgumentParser, default: Any) -> None:
    """--metadata-url and --json, before the command or after it (``default``: SUPPRESS on the
    command's parser, so that one given before the command is not overwritten)."""
    parser.add_argument(
        "--metadata-url",
        default=default,
        help=f"etcd://host:port[,host:port...]/prefix (default: ${METADATA_URL_ENV})",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        default=default if default is argparse.SUPPRESS else False,
        help="one JSON document on stdout",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m node shell",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(parser, None)
    commands = parser.add_subparsers(dest="shell_command", required=True, metavar="COMMAND")

    def command(name: str, text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=text, description=text)
        _common(sub, argparse.SUPPRESS)
        return sub

    command("listnodes", "nodes registered now or holding a cookie")
    command("listledgers", "every replicated ledger, in id order")
    command("ledgermetadata", "one ledger's metadata").add_argument("ledger", type=ledger_id)
    read = command("readledger", "a ledger's entries")
    read.add_argument("ledger", type=ledger_id)
    read.add_argument("--from", dest="first", type=entry_id, default=0, help="first entry id")
    read.add_argument(
        "--to",
        dest="last",
        type=entry_id,
        default=None,
        help="last entry id (default: lastEntryId, or the LAC of an open ledger)",
    )
    command("recover", "fence and recover a ledger, then close it").add_argument(
        "ledger", type=ledger_id
    )
    command("deleteledger", "delete a ledger").add_argument("ledger", type=ledger_id)
    readd = command(
        "readd",
        "recover the open ledgers of a wiped node, then retire its cookie: it may start again "
        "under its id as a new, empty node",
    )
    readd.add_argument("node", help="the node's id (NODE_ID)")
    readd.add_argument(
        "--force",
        action="store_true",
        help="even while the node is registered (its lease may linger after a crash)",
    )
    auditor = command("auditor", "one pass of the auditor: write the under-replicated markers")
    auditor.add_argument(
        "--once", action="store_true", required=True, help="one pass, then exit (required)"
    )
    auditor.add_argument(
        "--lost-node-delay",
        type=float,
        default=DEFAULT_LOST_NODE_DELAY_S,
        metavar="S",
        help="seconds a node is unregistered before it counts as lost (default: %(default)s)",
    )
    auditor.add_argument(
        "--check-ledgers",
        action="store_true",
        help="also ask each replica which ids of its settled fragments its index lacks",
    )
    auditor.add_argument(
        "--check-replicas",
        action="store_true",
        help="also read every settled entry from each replica and compare CRC32C",
    )
    rereplicate = command("rereplicate", "re-replicate what a ledger's marker names")
    rereplicate.add_argument("ledger", type=ledger_id)
    rereplicate.add_argument(
        "--grace",
        type=float,
        default=DEFAULT_OPEN_LEDGER_GRACE_S,
        metavar="S",
        help="an open ledger waits this long from its marker before it is recovered "
        "(default: %(default)s)",
    )
    rereplicate.add_argument(
        "--lock-ttl",
        type=int,
        default=DEFAULT_LOCK_TTL_S,
        metavar="S",
        help="the marker lock's lease: a worker that dies frees it after this "
        "(default: %(default)s)",
    )
    command("underreplicated", "the under-replicated markers")
    decommission = command("decommission", "move everything a node holds elsewhere")
    decommission.add_argument("node", help="the node's id (NODE_ID)")
    decommission.add_argument(
        "--wait",
        action="store_true",
        help="audit and re-replicate until no ledger names the node",
    )
    decommission.add_argument(
        "--lost-node-delay",
        type=float,
        default=DEFAULT_LOST_NODE_DELAY_S,
        metavar="S",
        help="the audits' lost-node delay with --wait (default: %(default)s)",
    )
    decommission.add_argument(
        "--grace",
        type=float,
        default=DEFAULT_OPEN_LEDGER_GRACE_S,
        metavar="S",
        help="open-ledger grace of the re-replication with --wait (default: %(default)s)",
    )
    recommission = command("recommission", "take a node's decommissioning mark away")
    recommission.add_argument("node", help="the node's id (NODE_ID)")
    return parser


# --- output -------------------------------------------------------------------------------------


def escape(payload: bytes) -> str:
    """``payload`` on one line: printable ASCII as is, backslash, newline, CR and tab as
    ``\\\\ \\n \\r \\t``, every other byte ``\\xNN``."""
    return "".join(chr(b) if b in _PRINTABLE else _ESCAPES.get(b, f"\\x{b:02x}") for b in payload)


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """Columns padded to their widest cell, two spaces apart."""
    cells = [[str(c) for c in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]


def _print_failure(as_json: bool, code: str, message: str) -> None:
    if as_json:
        print(json.dumps({"code": code, "message": message}))
    else:
        print(f"shell: {message}", file=sys.stderr)


# --- the commands -------------------------------------------------------------------------------


async def list_nodes(client: Client, _: argparse.Namespace) -> Outcome:
    registered = {
        key.removeprefix(NODES_PREFIX): NodeInfo.decode(versioned.value)
        for key, versioned in await client.store.range(NODES_PREFIX)
    }
    cookies = {}
    for key, versioned in await client.store.range(COOKIES_PREFIX):
        try:
            instance = str(json.loads(versioned.value).get("instanceId", ""))
        except (ValueError, AttributeError):
            instance = "?"  # another writer's value: listed, not fatal
        cookies[key.removeprefix(COOKIES_PREFIX)] = instance
    nodes = []
    for node_id in sorted(registered.keys() | cookies.keys()):
        info = registered.get(node_id)
        nodes.append(
            {
                "id": node_id,
                "url": info.url if info else None,
                "zone": info.zone if info else None,
                "state": info.state.value if info else None,
                "instance": (info.instance_id if info else "") or cookies.get(node_id, ""),
                "registered": info is not None,
            }
        )
    rows = [
        [
            n["id"],
            n["url"] or NONE,
            n["zone"] or NONE,
            n["state"] or NONE,
            n["instance"] or NONE,
            "yes" if n["registered"] else "no",
        ]
        for n in nodes
    ]
    header = ("id", "url", "zone", "state", "instance", "registered")
    return Outcome({"nodes": nodes}, table(header, rows))


async def list_ledgers(client: Client, _: argparse.Namespace) -> Outcome:
    ledgers = [
        {**decode(versioned.value).to_json(), "revision": versioned.revision}
        for _key, versioned in await client.store.range(LEDGERS_PREFIX)
    ]
    rows = [
        [
            m["ledgerId"],
            m["state"],
            f"{m['ensembleSize']}/{m['writeQuorumSize']}/{m['ackQuorumSize']}",
            m["lastEntryId"] if m["state"] == LedgerState.CLOSED else NONE,
            m["length"] if m["state"] == LedgerState.CLOSED else NONE,
            len(m["segments"]),
            ",".join(m["segments"][-1]["ensemble"]),
        ]
        for m in ledgers
    ]
    header = ("ledger", "state", "E/Qw/Qa", "lastEntryId", "length", "segments", "ensemble")
    return Outcome({"ledgers": ledgers}, table(header, rows))


async def ledger_metadata(client: Client, args: argparse.Namespace) -> Outcome:
    document = await client.ledger_metadata(args.ledger)
    return Outcome(document, json.dumps(document, indent=2).splitlines())


async def read_ledger(client: Client, args: argparse.Namespace) -> Outcome:
    reader = await client.open_ledger(args.ledger, recover=False)
    # Never past the end: lastEntryId of a CLOSED ledger, the LAC of an OPEN one.
    last = reader.last_entry_id if args.last is None else min(args.last, reader.last_entry_id)
    entries = []
    if args.first <= last:
        async for eid, payload in reader.read(args.first, last):
            entries.append((eid, bytes(payload)))
    document = {
        "ledgerId": args.ledger,
        "state": reader.metadata.state.value,
        "lastEntryId": reader.last_entry_id,
        "entries": [
            {"entryId": eid, "payload": base64.b64encode(p).decode("ascii")} for eid, p in entries
        ],
    }
    return Outcome(document, [f"{eid}\t{escape(p)}" for eid, p in entries])


async def _recover(client: Client, lid: int) -> tuple[str, dict[str, Any], str]:
    """Fence and recover ``lid`` (a CLOSED ledger is left as it is): its state before, its
    metadata after, and a line that says so."""
    before = (await client.ledger_metadata(lid))["state"]
    after = await client.recover_ledger(lid)
    line = (
        f"ledger {lid}: was {before}, now {after['state']} at lastEntryId "
        f"{after['lastEntryId']} ({after['length']} bytes)"
    )
    return before, after, line


async def recover(client: Client, args: argparse.Namespace) -> Outcome:
    before, after, line = await _recover(client, args.ledger)
    return Outcome({"before": before, "metadata": after}, [line])


async def delete_ledger(client: Client, args: argparse.Namespace) -> Outcome:
    await client.delete_ledger(args.ledger)
    return Outcome({"ledgerId": args.ledger, "deleted": True}, [f"ledger {args.ledger}: deleted"])


async def readd(client: Client, args: argparse.Namespace) -> Outcome:
    node = args.node
    registration = await client.store.get(node_key(node))
    if registration is not None and not args.force:
        info = NodeInfo.decode(registration.value)
        raise ShellFailure(
            NODE_REGISTERED,
            f"node {node} is registered (at {info.url}): stop it first (a crashed node's "
            "registration ends with its lease), or pass --force",
        )
    lines: list[str] = []
    recovered = []
    for _key, versioned in await client.store.range(LEDGERS_PREFIX):
        meta = decode(versioned.value)
        if meta.closed or node not in meta.last_segment.ensemble:
            continue
        _before, after, line = await _recover(client, meta.ledger_id)
        recovered.append(after)
        lines.append(line)
    # The cookie's rules are the node's (node/replication); imported here only, so that the
    # rest of node.client loads none of the node's code.
    from node.replication.cookie import retire

    retired = await retire(client.store, node)
    what = f"cookie {retired.instance_id} retired" if retired else "it had no cookie"
    lines.append(
        f"node {node}: {len(recovered)} open ledger(s) recovered, {what}; its next start "
        "makes it a new, empty node"
    )
    document = {
        "node": node,
        "recovered": recovered,
        "retiredInstance": retired.instance_id if retired else None,
    }
    return Outcome(document, lines)


def worker_id() -> str:
    """Who holds a marker's lock: this host and process, and a nonce for this run."""
    import socket
    import uuid

    return f"{socket.gethostname()}/pid {os.getpid()}/{uuid.uuid4().hex[:12]}"


async def auditor(client: Client, args: argparse.Namespace) -> Outcome:
    from node.autorecovery.auditor import audit

    report = await audit(
        client,
        lost_node_delay_s=args.lost_node_delay,
        check_ledgers=args.check_ledgers,
        check_replicas=args.check_replicas,
    )
    document = {**report.to_json(), "markers": report.markers}
    lines = [
        f"{report.checked_ledgers} ledger(s) audited, {report.under_replicated_ledgers} "
        f"under-replicated ({report.under_replicated_fragments} fragment(s)); markers "
        f"created {report.markers_created}, removed {report.markers_removed}",
        f"lost: {', '.join(report.lost_nodes) or NONE}; decommissioning: "
        f"{', '.join(report.decommissioning_nodes) or NONE}",
    ]
    waiting = await _not_lost_yet(client, report.lost_nodes, args.lost_node_delay)
    if waiting:
        lines.append(
            f"unregistered, not counted lost yet: {', '.join(waiting)} (--lost-node-delay "
            f"{args.lost_node_delay:g} s: how long a node may be away before its copies are made)"
        )
    if args.check_replicas:
        lines.append(f"replicas check: {report.replicas_checked} entries read")
    elif args.check_ledgers:
        lines.append(f"ledger check: {report.fragments_checked} fragment(s) asked")
    if args.check_replicas or args.check_ledgers:
        lines.append(f"entries missing on a replica: {report.entries_missing}")
    return Outcome(document, lines)


async def _not_lost_yet(client: Client, lost: list[str], delay_s: float) -> list[str]:
    """Nodes the auditor noted unregistered that the delay has not made lost yet, each with
    when it will (a newcomer who killed a node sees why nothing was marked)."""
    from node.autorecovery import markers as m

    waiting = []
    for key, found in await client.store.range(m.LOST_PREFIX):
        node = key.removeprefix(m.LOST_PREFIX)
        if node not in lost:
            at = (m.decode_since(found.value) + delay_s * 1000) / 1000
            when = datetime.datetime.fromtimestamp(at, datetime.UTC).strftime("%H:%M:%S UTC")
            waiting.append(f"{node} (lost at {when})")
    return waiting


async def rereplicate(client: Client, args: argparse.Namespace) -> Outcome:
    from node.autorecovery.worker import rereplicate as run

    result = await run(
        client,
        args.ledger,
        worker_id=worker_id(),
        open_ledger_grace_s=args.grace,
        lock_ttl_s=args.lock_ttl,
    )
    line = (
        f"ledger {args.ledger}: {result.outcome}, {result.fragments} fragment(s), "
        f"{result.entries} entries, {result.size} bytes copied"
    )
    return Outcome(result.to_json(), [line])


async def underreplicated(client: Client, _: argparse.Namespace) -> Outcome:
    from node.autorecovery import markers

    locks = {
        key.removeprefix(markers.LOCKS_PREFIX): markers.Lock.decode(v.value).worker
        for key, v in await client.store.range(markers.LOCKS_PREFIX)
    }
    found: list[dict[str, Any]] = []
    for marker, _versioned in await markers.read_markers(client.store):
        found.append(
            {
                "ledgerId": marker.ledger_id,
                "nodes": {n: r.value for n, r in sorted(marker.nodes.items())},
                "createdMs": marker.created_ms,
                "lockedBy": locks.get(f"{marker.ledger_id:019d}"),
            }
        )
    rows = [
        [
            f["ledgerId"],
            ",".join(f"{n}:{r}" for n, r in f["nodes"].items()),
            f["createdMs"],
            f["lockedBy"] or NONE,
        ]
        for f in found
    ]
    return Outcome({"markers": found}, table(("ledger", "nodes", "createdMs", "locked by"), rows))


# Between two rounds of ``decommission --wait`` (a marker locked by another worker, a node
# still registered): long enough not to spin, short next to a copy.
DECOMMISSION_POLL_S = 1.0


async def decommission(client: Client, args: argparse.Namespace) -> Outcome:
    from node.autorecovery.auditor import audit
    from node.autorecovery.decommission import decommission as mark
    from node.autorecovery.decommission import still_needed
    from node.autorecovery.worker import rereplicate as run

    await mark(client, args.node)
    needed = await still_needed(client, args.node)
    me = worker_id()
    while args.wait and needed:
        report = await audit(client, lost_node_delay_s=args.lost_node_delay)
        for lid in set(report.markers) & set(needed):
            await run(
                client,
                lid,
                worker_id=me,
                open_ledger_grace_s=args.grace,
                lock_ttl_s=DEFAULT_LOCK_TTL_S,
            )
        needed = await still_needed(client, args.node)
        if needed:
            await asyncio.sleep(DECOMMISSION_POLL_S)
    line = (
        f"node {args.node}: decommissioning; {len(needed)} ledger(s) still name it"
        if needed
        else f"node {args.node}: decommissioning; no ledger names it, it may go"
    )
    return Outcome({"node": args.node, "stillNeeded": needed}, [line])


async def recommission(client: Client, args: argparse.Namespace) -> Outcome:
    from node.autorecovery.decommission import recommission as unmark

    removed = await unmark(client, args.node)
    line = (
        f"node {args.node}: no longer decommissioning"
        if removed
        else f"node {args.node}: was not decommissioning"
    )
    return Outcome({"node": args.node, "removed": removed}, [line])


Command = Callable[["Client", argparse.Namespace], Awaitable[Outcome]]
COMMANDS: dict[str, Command] = {
    "listnodes": list_nodes,
    "listledgers": list_ledgers,
    "ledgermetadata": ledger_metadata,
    "readledger": read_ledger,
    "recover": recover,
    "deleteledger": delete_ledger,
    "readd": readd,
    "auditor": auditor,
    "rereplicate": rereplicate,
    "underreplicated": underreplicated,
    "decommission": decommission,
    "recommission": recommission,
}


async def _run(args: argparse.Namespace) -> Outcome:
    from node.client import Client

    async with Client(args.metadata_url, token=os.environ.get(TOKEN_ENV) or None) as client:
        return await COMMANDS[args.shell_command](client, args)


def main(argv: list[str]) -> int:
    """Runs the command of ``argv`` (what follows ``shell``); prints its outcome; the exit
    status (argparse exits 2 itself on bad arguments)."""
    from node.client.metadata.etcd import parse_url

    args = build_parser().parse_args(argv)
    as_json = bool(args.json)
    args.metadata_url = args.metadata_url or os.environ.get(METADATA_URL_ENV, "")
    try:
        if not args.metadata_url:
            raise UsageError(f"no metadata store: pass --metadata-url or set {METADATA_URL_ENV}")
        try:
            parse_url(args.metadata_url)
        except MetadataUrlError as e:
            raise UsageError(str(e)) from None
    except UsageError as e:
        _print_failure(as_json, "usage", str(e))
        return EXIT_USAGE
    try:
        outcome = asyncio.run(_run(args))
    except ShellFailure as e:
        _print_failure(as_json, e.code, str(e))
        return EXIT_FAILED
    except (ClientError, MetadataFormatError) as e:
        _print_failure(as_json, error_code(e), str(e))
        return EXIT_FAILED
    if as_json:
        print(json.dumps(outcome.document, indent=2))
    else:
        print("\n".join(outcome.lines))
    return EXIT_OK
