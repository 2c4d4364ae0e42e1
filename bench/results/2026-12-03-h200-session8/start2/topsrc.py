# Top source lines by warp stall samples from `ncu --page source --csv` output (one or more tables).
import csv, sys, io
text = open(sys.argv[1], errors="replace").read().splitlines()
tables, cur = [], None
for line in text:
    if line.startswith('"') and ("Source" in line[:200] or "Address" in line[:200]) and "Warp Stall" in line:
        cur = [line]; tables.append(cur)
    elif cur is not None and line.startswith('"'):
        cur.append(line)
    elif not line.startswith('"'):
        cur = None
        if line.strip(): print("#", line[:200])
for t in tables:
    rows = list(csv.reader(io.StringIO("\n".join(t))))
    head = rows[0]
    col = [i for i, h in enumerate(head) if h.startswith("Warp Stall Sampling (All")][0]
    src = [i for i, h in enumerate(head) if h in ("Source", "# Address", "Address")]
    keep = [i for i, h in enumerate(head) if h.startswith("Warp Stall Sampling") or h in ("#", "Line", "# Address", "Address", "Source")]
    def num(r):
        try: return float(r[col].replace(",", ""))
        except: return 0.0
    body = [r for r in rows[1:] if len(r) == len(head)]
    total = sum(num(r) for r in body)
    print("== table:", len(body), "rows, samples", total, "| columns:", [head[i] for i in keep])
    for r in sorted(body, key=num, reverse=True)[:45]:
        print(f"{num(r):8.0f} {100*num(r)/max(total,1):5.1f}% | " + " | ".join(r[i][:110] for i in keep if i != col))
