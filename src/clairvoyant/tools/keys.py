"""`clairvoyant keys`: make a client API key, or hash an existing one, for the ``api_keys`` setting.

The key is printed once; the config keeps only its hash (``sha256:<hex>``).
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    add = sub.add_parser("add", help="make a new key for a tenant and print its config entry")
    add.add_argument("--tenant", required=True, help="the tenant its requests belong to")
    add.add_argument("--min-priority", type=int, default=0, help="most urgent priority it may ask for (default 0)")
    add.add_argument("--max-priority", type=int, default=10, help="least urgent priority it may ask for (default 10)")
    add.add_argument("--weight", type=float, default=1.0, help="the tenant's fair-share weight (default 1)")
    hash_ = sub.add_parser("hash", help="print the hash of an existing key (read from standard input)")
    hash_.set_defaults(tenant=None)


def run(args: argparse.Namespace) -> int:
    from clairvoyant.config import ApiKey
    from clairvoyant.proxy.access import hash_key, new_key

    if args.keys_command == "hash":
        key = sys.stdin.readline().strip()
        if not key:
            print("clairvoyant keys hash: no key on standard input", file=sys.stderr)
            return 2
        print(hash_key(key))
        return 0
    key = new_key()
    entry = ApiKey(
        hash=hash_key(key),
        tenant=args.tenant,
        min_priority=args.min_priority,
        max_priority=args.max_priority,
        weight=args.weight,
    )  # validates the range and weight
    print(f"# the key (shown once; give it to the client as Authorization: Bearer KEY):\n# {key}")
    print("[[api_keys]]")
    print(f'hash = "{entry.hash}"')
    print(f"tenant = {_toml_string(entry.tenant)}")
    print(f"min_priority = {entry.min_priority}\nmax_priority = {entry.max_priority}\nweight = {entry.weight}")
    return 0


def _toml_string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
