def parse_config(text):
    """Parse INI-like config text into {section: {key: value}}."""
    result = {}
    section = "default"
    result[section] = {}
    last_key = None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.rstrip()
        if not line or line.lstrip().startswith(("#", ";")):
            continue
        if line[0] in " \t" and last_key is not None:
            # A continuation line: append it to the previous value.
            result[section][last_key] += "\n" + line.strip()
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1].strip()
            if not section:
                raise ValueError(f"line {number}: empty section name")
            result.setdefault(section, {})
            last_key = None
            continue
        if "=" not in line:
            raise ValueError(f"line {number}: expected key = value, got {line!r}")
        key, value = line.split("=", 1)
        key = key.strip().lower()
        value = value.split(" #", 1)[0].strip()
        result[section][key] = value
        last_key = key
    if not result["default"]:
        del result["default"]
    return result
