"""`clairvoyant keys`: make a client API key, or hash an existing one, for the ``api_keys`` setting.

    clairvoyant keys add --tenant team-a >> clairvoyant-keys.toml   # api_keys_file = "clairvoyant-keys.toml"
    clairvoyant keys hash < key.txt

``keys add`` shows the new key once, on standard error (the terminal, when standard output goes to a
file), and writes only its config entry to standard output: the ``[[api_keys]]`` table with the key's
hash (``sha256:<hex>``), never the key itself. So the file it is appended to holds no secret. That
file is the keys file (``api_keys_file``), not the settings file: in TOML, a setting appended after
a table would belong to the table.
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    add = sub.add_parser(
        "add", help="make a new key for a tenant: the key on standard error, its config entry on standard output"
    )
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
    # The key goes to standard error only: standard output is the config entry, meant for a file.
    print(
        f"New key for tenant {entry.tenant!r}, shown this once (the config keeps only its hash):\n"
        f"  {key}\n"
        "Give it to the client, which sends it as Authorization: Bearer KEY (or X-Api-Key: KEY).",
        file=sys.stderr,
    )
    print()  # appended with >>, the entry starts on a line of its own, whatever the file ended with
    print("[[api_keys]]")
    print(f'hash = "{entry.hash}"')
    print(f"tenant = {_toml_string(entry.tenant)}")
    print(f"min_priority = {entry.min_priority}\nmax_priority = {entry.max_priority}\nweight = {entry.weight}")
    return 0


def _toml_string(value: str) -> str:
    """A TOML basic string: JSON's escapes (quote, backslash, control characters, \\uXXXX) are TOML's."""
    return json.dumps(value)
