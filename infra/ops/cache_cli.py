"""``alignflow cache ls | show KEY | verify [KEY…] | gc --older-than 7d``: the reference log-prob cache."""

from __future__ import annotations

import argparse
import json
import sys

from infra.core.settings import get_settings


def add_cache_parser(commands) -> None:
    cache = commands.add_parser("cache", help="inspect and clean the reference log-prob cache", description=__doc__)
    actions = cache.add_subparsers(dest="action", required=True)
    root_help = (
        "cache root: folder or fsspec URL (default: ALIGNFLOW_REFERENCE_CACHE, else $ALIGNFLOW_HOME/cache/reference)"
    )
    parsers = {
        "ls": actions.add_parser("ls", help="list entries: key, created, pairs per split, size"),
        "show": actions.add_parser("show", help="print an entry's manifest and verify it"),
        "verify": actions.add_parser(
            "verify", help="check every file's row count and sha256 (exit 1 if any entry is bad)"
        ),
        "gc": actions.add_parser("gc", help="remove entries (and abandoned staging folders) created before a time"),
    }
    for parser in parsers.values():
        parser.add_argument("--root", help=root_help)
    parsers["show"].add_argument("key", help="entry key or a unique prefix of it")
    parsers["verify"].add_argument("keys", nargs="*", help="entries to check (default: all)")
    parsers["verify"].add_argument(
        "--delete", action="store_true", help="remove the entries that fail (they are rebuilt when next needed)"
    )
    parsers["gc"].add_argument("--older-than", required=True, metavar="AGE", help="e.g. 90m, 12h, 7d, 2w")
    parsers["gc"].add_argument("--dry-run", action="store_true", help="only print what would be removed")


def open_store(args: argparse.Namespace):
    from infra.core.refcache import ReferenceCache

    return ReferenceCache(args.root or get_settings().reference_cache_root)


def list_entries(store, args) -> int:
    from infra.core.refcache import CacheIntegrityError

    print(f"{'KEY':<22}{'CREATED (UTC)':<22}{'PAIRS':<14}{'SIZE':>10}  STATE")
    for key in store.keys():
        try:
            manifest = store.manifest(key)
            created, pairs, state = (
                manifest["created_at"][:19].replace("T", " "),
                "+".join(str(s["rows"]) for s in manifest["splits"].values()),
                "complete",
            )
        except (CacheIntegrityError, KeyError, TypeError, AttributeError):
            created, pairs, state = "-", "-", "partial (rebuilt on next use)"
        print(f"{key:<22}{created:<22}{pairs:<14}{store.size(key) / 1024:>8.1f}Ki  {state}")
    return 0


def show_entry(store, args) -> int:
    from infra.core.refcache import CacheIntegrityError

    matches = [key for key in store.keys() if key.startswith(args.key)]
    if len(matches) != 1:
        print(f"alignflow cache: {len(matches)} entries match {args.key!r} under {store.root}", file=sys.stderr)
        return 1
    (key,) = matches
    try:
        print(json.dumps(store.manifest(key), indent=2))
        store.read(key)
    except CacheIntegrityError as problem:
        print(f"verified: CORRUPT: {problem}")
        return 1
    print(f"verified: ok ({store.uri(key)})")
    return 0


def verify_entries(store, args) -> int:
    from infra.core.refcache import CacheIntegrityError

    bad = 0
    for key in args.keys or store.keys():
        try:
            store.read(key)
            print(f"{key}  ok")
        except CacheIntegrityError as problem:
            bad += 1
            print(f"{key}  CORRUPT: {problem}")
            if args.delete:
                store.remove(key)
                print(f"{key}  removed")
    return 1 if bad else 0


def collect_garbage(store, args) -> int:
    from infra.core.refcache import parse_duration

    try:
        age = parse_duration(args.older_than)
    except ValueError as error:
        print(f"alignflow cache gc: {error}", file=sys.stderr)
        return 2
    for name in store.gc(age, dry_run=args.dry_run):
        print(f"{'would remove' if args.dry_run else 'removed'} {name}")
    return 0


CACHE_ACTIONS = {"ls": list_entries, "show": show_entry, "verify": verify_entries, "gc": collect_garbage}


def cache_command(args: argparse.Namespace) -> int:
    return CACHE_ACTIONS[args.action](open_store(args), args)
