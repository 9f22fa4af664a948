"""Print the N slowest tests of a pytest JUnit XML report (its time per test: set-up, call and teardown)."""

import sys
import xml.etree.ElementTree as ET

report, count = sys.argv[1], int(sys.argv[2])
cases = [(float(case.get("time", 0)), f"{case.get('classname', '')}::{case.get('name', '')}")
         for case in ET.parse(report).iter("testcase")]
total = sum(seconds for seconds, _ in cases)
print(f"{len(cases)} tests, {total:.0f} s in tests; the {min(count, len(cases))} slowest:")
for seconds, name in sorted(cases, reverse=True)[:count]:
    print(f"{seconds:8.1f} s  {name}")
