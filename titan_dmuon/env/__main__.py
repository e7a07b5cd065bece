"""Print the environment report: ``python -m titan_dmuon.env`` (paste its output into a bug report)."""

from titan_dmuon.env import report

if __name__ == "__main__":
    print(report())
