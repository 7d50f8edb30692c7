"""The contract version. A plugin written for another major version is not used."""

API_VERSION = "1.2"


def api_major(version: str) -> int:
    return int(str(version).split(".", 1)[0])
