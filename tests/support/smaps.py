"""What /proc/self/smaps says of the mapping that holds an address (Linux only)."""


def mapping_field(address: int, field: str) -> list[str]:
    """The values of ``field`` (e.g. ``"Rss:"``, ``"VmFlags:"``) of the mapping holding ``address``."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == field:
                return line.split()[1:]
    raise AssertionError(f"no mapping holds address {address:#x}")
