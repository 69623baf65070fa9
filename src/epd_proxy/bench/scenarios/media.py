"""media: big images through the encoder stage: the proxy's CPU against image size."""

from __future__ import annotations

import math

from epd_proxy.bench.lab import Lab, lab_settings, workload_requests
from epd_proxy.bench.markdown import fmt, table
from epd_proxy.bench.scenarios.base import Figures, Limit, Scenario, float_list, target_check
from epd_proxy.bench.stats import linear_fit


def add_arguments(group) -> None:
    group.add_argument("--media-mb", type=float_list, default=[0.25, 0.5, 1, 2, 4], help="media: image sizes in MiB")


async def run(args) -> dict:
    """One image of growing size per request (E+P+D, stream, 4 tokens): proxy CPU per
    request against the image size, and a least-squares line through it."""
    settings = lab_settings(args, sim={"itl_ms": 1.0})
    out: dict = {"sizes_mb": list(args.media_mb), "points": []}
    with Lab(settings) as lab:
        lab.pin_self()
        lab.start_sim()
        proxy = lab.start_proxy()
        for mb in args.media_mb:
            reqs = workload_requests(args, "mm", images=1, image_kb=mb * 1024, max_tokens=4, variants=2)
            res = await lab.phase(proxy, reqs, concurrency=2, warmup=0.5, duration=max(3.0, args.duration),
                                  max_requests=None, verify=args.verify != "off", label=f"media {mb:g} MiB",
                                  progress=args.progress, seed=args.seed)
            res["image_mb"] = mb
            res["body_mb"] = len(reqs[0].body) / 2**20
            out["points"].append(res)
    pts = [p for p in out["points"] if p["requests"] and not math.isnan(p.get("target_cpu_ms_per_req", math.nan))]
    if len(pts) >= 2:
        fit = linear_fit([p["image_mb"] for p in pts], [p["target_cpu_ms_per_req"] for p in pts])
        out["fit"] = fit
        out["ms_per_mb"] = fit["slope"]
        body = linear_fit([p["body_mb"] for p in pts], [p["target_cpu_ms_per_req"] for p in pts])
        out["ms_per_body_mb"] = body["slope"]
    return out


def section(r: dict, plots: dict) -> list[str]:
    out = ["## Big media through the encoder stage", ""]
    rows = [[fmt(p["image_mb"]), fmt(p["body_mb"]), fmt(p.get("target_cpu_ms_per_req"), 3), fmt(p["req_s"], 1),
             f"{p['errors']} / {p['verify_errors']}", str(p["requests"])] for p in r.get("points", [])]
    out += [table(["image MiB", "request body MiB", "proxy CPU ms/req", "req/s", "errors / mismatches",
                    "requests"], rows), ""]
    if "fit" in r:
        f = r["fit"]
        out.append(f"Least squares: **{fmt(f['slope'], 3)} ms per MiB of image** ({fmt(r.get('ms_per_body_mb'), 3)} "
                   f"ms per MiB of request body) + {fmt(f['intercept'], 3)} ms; R² = {f['r2']:.4f}.")
        out.append("")
    if "media" in plots:
        out += [f"![CPU against image size]({plots['media']})", ""]
    return out


LIMITS = {"media_linear": Limit("Encoder-stage CPU linear in image size (R^2)", 0.98, "", ">=")}


def plot(r: dict, figures: Figures) -> dict[str, str]:
    pts = r.get("points")
    if not pts:
        return {}
    fig, ax = figures.new(figsize=(6, 4))
    xs = [p["image_mb"] for p in pts]
    ax.plot(xs, [p.get("target_cpu_ms_per_req") for p in pts], "o", label="measured")
    if "fit" in r:
        f = r["fit"]
        ax.plot([0, max(xs)], [f["intercept"], f["intercept"] + f["slope"] * max(xs)], "-",
                label=f"{f['slope']:.2f} ms/MiB + {f['intercept']:.2f} ms")
    ax.set_xlabel("image MiB (before base64)")
    ax.set_ylabel("proxy CPU ms per request")
    ax.set_title("encoder stage: CPU against image size")
    return {"media": figures.save(fig, [ax], "media_cpu.png")}


def checks(r: dict) -> list[dict]:
    if "fit" not in r:
        return []
    return [target_check("media_linear", LIMITS["media_linear"], r["fit"]["r2"], "media",
                         f"{fmt(r['ms_per_mb'])} ms per MiB of image (+{fmt(r['fit']['intercept'])} ms fixed)")]


SCENARIO = Scenario("media", run=run, section=section, add_arguments=add_arguments, plot=plot, checks=checks)
