"""Re-render bench/results/<name>.md from bench/results/<name>.json for the named benchmarks (default: every
result that has a template), through the one renderer of `bench.common`."""

from __future__ import annotations

from bench import common


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("names", nargs="*", help="benchmarks to re-render (default: all)")
    a = ap.parse_args()
    names = a.names or sorted(p.stem for p in a.out.glob("*.json") if (common.TEMPLATES / f"{p.stem}.md.j2").is_file())
    for name in names:
        common.write_report(name, a.out)
        print(f"{a.out / name}.md")


if __name__ == "__main__":
    main()
