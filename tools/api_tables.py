"""Print docs/api.md's field tables from the code (app/api/requests.FIELDS): paste them
over the old ones when a field changes (tests/unit/test_api_fields.py holds the two
together)."""

from compushare.app.api.requests import FIELDS


def tables() -> str:
    out = []
    for endpoint, fields in FIELDS.items():
        out += [f"### {endpoint}", "", "| field | handling | note |", "|---|---|---|"]
        out += [f"| `{f.name}` | {f.handling} | {f.note.replace('|', chr(92) + '|')} |" for f in fields]
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(tables())
