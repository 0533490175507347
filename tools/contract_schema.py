"""The contract's JSON Schema: `python -m tools.contract_schema [--write]`.

Prints the schema generated from `gpuinfra_contract.PlatformOutputs`; with `--write` stores it as
`gpuinfra_contract/schema/contract-<CONTRACT_VERSION>.json` (run it after changing the model or
bumping `CONTRACT_VERSION`, and commit the file). `--check` exits 1 when the committed file differs.
Schemas of older contract versions stay in the folder for consumers still reading them.
"""

from __future__ import annotations

import argparse
import sys

from gpuinfra_contract.json_schema import contract_json_schema, render, schema_path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.contract_schema", description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="write the committed schema file")
    mode.add_argument("--check", action="store_true", help="exit 1 if the committed schema file is stale")
    ns = ap.parse_args(argv)
    text, path = render(contract_json_schema()), schema_path()
    if ns.write:
        path.parent.mkdir(parents=True, exist_ok=True)
        changed = not path.exists() or path.read_text() != text
        path.write_text(text)
        print(f"{path}: {'written' if changed else 'unchanged'}")
    elif ns.check:
        if not path.exists() or path.read_text() != text:
            print(f"{path} is stale: run `python -m tools.contract_schema --write`", file=sys.stderr)
            return 1
        print(f"{path}: up to date")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
