// Self-contained HTML report of a run's metrics (see report.h): series extraction and
// decimation in C++, drawing by a small inline script into SVG.
#include "train/report.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>

#include "core/error.h"
#include "core/log.h"
#include "core/text_io.h"
#include "train/checkpoint.h"  // write_file_atomic
#include "train/metrics.h"

namespace opd {
namespace fs = std::filesystem;
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// JSON for embedding inside <script>: "<" only occurs inside strings, where \u003c is the same
// character, so "</script>" in a key or config value cannot end the script element.
std::string embed_json(const nlohmann::json& j) {
  const std::string s = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == '<') out += "\\u003c";
    else out += c;
  }
  return out;
}

nlohmann::json number_or_null(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr); }

// The drawing script. Kept dependency-free and defensive: one failing plot is marked
// data-rendered="error" with the message instead of stopping the others.
constexpr const char* kScript = R"JS(
(function () {
  "use strict";
  var NS = "http://www.w3.org/2000/svg";
  var data = JSON.parse(document.getElementById("opd-data").textContent);
  function el(name, attrs, parent) {
    var e = document.createElementNS(NS, name);
    for (var k in attrs) e.setAttribute(k, String(attrs[k]));
    if (parent) parent.appendChild(e);
    return e;
  }
  function html(name, cls, text, parent) {
    var e = document.createElement(name);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  function fmt(v) {
    if (v === 0) return "0";
    var a = Math.abs(v);
    if (a >= 1e6 || a < 1e-3) return v.toExponential(2).replace("e+", "e");
    return String(+v.toPrecision(4));
  }
  function ticks(lo, hi, n) {
    var span = hi - lo, step = Math.pow(10, Math.floor(Math.log10(span / n)));
    var err = span / n / step;
    if (err >= 7.5) step *= 10; else if (err >= 3.5) step *= 5; else if (err >= 1.5) step *= 2;
    var out = [];
    for (var v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9 && out.length < 50; v += step)
      out.push(Math.abs(v) < step * 1e-9 ? 0 : v);
    return out;
  }
  function range(lo, hi) {  // pads a degenerate or tight range so the line is not on an edge
    if (!(hi > lo)) { var p = lo === 0 ? 1 : Math.abs(lo) * 0.1; return [lo - p, hi + p]; }
    var m = (hi - lo) * 0.05;
    return [lo - m, hi + m];
  }
  function plot(s, box) {
    var W = 480, H = 250, L = 62, R = 14, T = 12, B = 30;
    var xs = s.x, ys = s.y, n = 0, x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
    for (var i = 0; i < xs.length; i++) {
      if (ys[i] === null) continue;
      n++;
      x0 = Math.min(x0, xs[i]); x1 = Math.max(x1, xs[i]);
      y0 = Math.min(y0, ys[i]); y1 = Math.max(y1, ys[i]);
    }
    var last = null;
    for (var j = ys.length - 1; j >= 0; j--) if (ys[j] !== null) { last = ys[j]; break; }
    var head = html("div", "plot-title", s.name, box);
    if (last !== null) html("span", "last", "last " + fmt(last), head);
    if (s.non_finite) html("span", "warn", s.non_finite + " non-finite (gaps)", head);
    if (s.decimated) html("span", "note", s.finite + " points, decimated", head);
    var svg = el("svg", {viewBox: "0 0 " + W + " " + H, width: W, height: H}, box);
    if (n === 0) {
      el("text", {x: W / 2, y: H / 2, "text-anchor": "middle", "class": "note"}, svg).textContent = "no finite values";
      return 0;
    }
    if (x1 === x0) { x0 -= 1; x1 += 1; }
    var yr = range(y0, y1); y0 = yr[0]; y1 = yr[1];
    function px(x) { return L + (x - x0) / (x1 - x0) * (W - L - R); }
    function py(y) { return T + (1 - (y - y0) / (y1 - y0)) * (H - T - B); }
    var axes = el("g", {"class": "axes"}, svg);
    el("line", {x1: L, y1: H - B, x2: W - R, y2: H - B}, axes);
    el("line", {x1: L, y1: T, x2: L, y2: H - B}, axes);
    ticks(x0, x1, 5).forEach(function (t) {
      if (t !== Math.round(t)) return;  // steps are integers
      el("line", {x1: px(t), y1: H - B, x2: px(t), y2: H - B + 4}, axes);
      el("text", {x: px(t), y: H - B + 16, "text-anchor": "middle"}, axes).textContent = fmt(t);
    });
    ticks(y0, y1, 5).forEach(function (t) {
      el("line", {x1: L - 4, y1: py(t), x2: W - R, y2: py(t), "class": "grid"}, axes);
      el("text", {x: L - 6, y: py(t) + 4, "text-anchor": "end"}, axes).textContent = fmt(t);
    });
    // Path segments break at gaps (null); an isolated point gets a dot so it stays visible.
    var d = "", seg = 0, dots = n <= 60, pts = [];
    for (var k = 0; k < xs.length; k++) {
      if (ys[k] === null) { seg = 0; continue; }
      var a = px(xs[k]).toFixed(1), b = py(ys[k]).toFixed(1);
      d += (seg ? "L" : "M") + a + " " + b;
      var alone = !seg && (k + 1 >= xs.length || ys[k + 1] === null);
      if (dots || alone) el("circle", {cx: a, cy: b, r: 2.2, "class": "dot"}, svg);
      seg++;
      pts.push(k);
    }
    el("path", {d: d, "class": "line"}, svg);
    var mark = el("circle", {r: 3.5, "class": "mark", visibility: "hidden"}, svg);
    var tip = el("text", {x: W - R, y: T + 10, "text-anchor": "end", "class": "tip"}, svg);
    svg.addEventListener("mousemove", function (ev) {
      var r = svg.getBoundingClientRect();
      var x = x0 + ((ev.clientX - r.left) * W / r.width - L) / (W - L - R) * (x1 - x0);
      var lo = 0, hi = pts.length - 1;
      while (lo < hi) { var mid = (lo + hi) >> 1; if (xs[pts[mid]] < x) lo = mid + 1; else hi = mid; }
      if (lo > 0 && Math.abs(xs[pts[lo - 1]] - x) < Math.abs(xs[pts[lo]] - x)) lo--;
      var q = pts[lo];
      mark.setAttribute("cx", px(xs[q])); mark.setAttribute("cy", py(ys[q]));
      mark.setAttribute("visibility", "visible");
      tip.textContent = "step " + xs[q] + ": " + fmt(ys[q]);
    });
    svg.addEventListener("mouseleave", function () { mark.setAttribute("visibility", "hidden"); tip.textContent = ""; });
    return n;
  }
  document.title = data.title;
  document.getElementById("title").textContent = data.title;
  document.getElementById("summary").textContent = data.summary;
  if (data.config !== null) document.getElementById("config").textContent = JSON.stringify(data.config, null, 2);
  else document.getElementById("config-box").style.display = "none";
  if (data.config_error) html("p", "warn", "config.json: " + data.config_error, document.getElementById("header"));
  var plots = document.getElementById("plots"), rendered = 0;
  if (data.series.length === 0) html("p", "note", "No numeric metrics yet.", plots);
  data.series.forEach(function (s) {
    var box = html("div", "plot", undefined, plots);
    box.setAttribute("data-series", s.name);
    try {
      var n = plot(s, box);
      box.setAttribute("data-rendered", "1");
      box.setAttribute("data-points", String(n));
      rendered++;
    } catch (e) {
      box.setAttribute("data-rendered", "error");
      html("p", "warn", "plot failed: " + e, box);
    }
  });
  document.body.setAttribute("data-plots", String(data.series.length));
  document.body.setAttribute("data-plots-rendered", String(rendered));
})();
)JS";

constexpr const char* kStyle = R"CSS(
body { font-family: sans-serif; margin: 16px; color: #222; background: #fff; }
h1 { font-size: 20px; margin: 0 0 4px 0; }
#summary { color: #555; font-size: 13px; margin-bottom: 8px; }
pre { background: #f6f6f6; padding: 8px; font-size: 12px; max-height: 360px; overflow: auto; }
#plots { display: flex; flex-wrap: wrap; gap: 12px; margin-top: 12px; }
.plot { border: 1px solid #ddd; padding: 6px; }
.plot-title { font-size: 14px; font-weight: bold; margin-bottom: 2px; }
.plot-title span { font-weight: normal; font-size: 12px; margin-left: 8px; }
.last { color: #555; } .warn { color: #b00; } .note { color: #777; }
svg { display: block; max-width: 100%; height: auto; }
.axes line { stroke: #999; stroke-width: 1; } .axes line.grid { stroke: #eee; }
.axes text, text.tip, text.note { font-size: 11px; fill: #444; }
path.line { fill: none; stroke: #1f6fb4; stroke-width: 1.5; }
circle.dot { fill: #1f6fb4; } circle.mark { fill: none; stroke: #d33; stroke-width: 1.5; }
)CSS";

std::string format_utc(double unix_s) {
  if (!std::isfinite(unix_s)) return "?";
  const std::time_t t = static_cast<std::time_t>(unix_s);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S UTC", &tm);
  return buf;
}

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const int64_t v = static_cast<int64_t>(std::llround(s));
  return cat(v / 3600, "h ", v / 60 % 60, "m ", v % 60, "s");
}

}  // namespace

std::vector<MetricSeries> extract_series(const std::vector<nlohmann::json>& records) {
  std::map<std::string, std::map<int64_t, double>> by_key;  // sorted keys, sorted unique steps
  std::map<std::string, bool> numeric;
  for (const nlohmann::json& r : records) {
    if (!r.is_object()) continue;
    const auto st = r.find("step");
    if (st == r.end() || !st->is_number_integer()) continue;
    const int64_t step = st->get<int64_t>();
    for (const auto& [key, value] : r.items()) {
      if (key == "step" || key == "time") continue;
      if (value.is_number()) {
        by_key[key][step] = value.get<double>();
        if (std::isfinite(value.get<double>())) numeric[key] = true;
      } else if (value.is_null()) {
        by_key[key][step] = kNaN;  // a non-finite value as MetricsLog writes it: a gap
      }
    }
  }
  std::vector<MetricSeries> out;
  for (const auto& [key, points] : by_key) {
    if (!numeric.count(key)) continue;  // only nulls: nothing to draw
    MetricSeries s;
    s.name = key;
    for (const auto& [step, v] : points) {
      s.steps.push_back(step);
      s.values.push_back(v);
      (std::isfinite(v) ? s.finite : s.non_finite)++;
    }
    out.push_back(std::move(s));
  }
  return out;
}

MetricSeries decimate(const MetricSeries& s, int64_t max_points) {
  const int64_t n = static_cast<int64_t>(s.steps.size());
  if (max_points <= 0 || n <= max_points) return s;
  MetricSeries d;
  d.name = s.name;
  d.finite = s.finite;
  d.non_finite = s.non_finite;
  // Each bucket contributes its minimum and maximum in step order, plus a NaN when it holds a
  // gap, so at most 3 points per bucket.
  const int64_t buckets = std::max<int64_t>(1, max_points / 3);
  for (int64_t b = 0; b < buckets; ++b) {
    const int64_t lo = b * n / buckets, hi = (b + 1) * n / buckets;
    int64_t imin = -1, imax = -1;
    bool gap = false;
    for (int64_t i = lo; i < hi; ++i) {
      const double v = s.values[i];
      if (!std::isfinite(v)) {
        gap = true;
        continue;
      }
      if (imin < 0 || v < s.values[imin]) imin = i;
      if (imax < 0 || v > s.values[imax]) imax = i;
    }
    if (imin >= 0) {
      const int64_t first = std::min(imin, imax), second = std::max(imin, imax);
      d.steps.push_back(s.steps[first]);
      d.values.push_back(s.values[first]);
      if (second != first) {
        d.steps.push_back(s.steps[second]);
        d.values.push_back(s.values[second]);
      }
    }
    if (gap) {
      d.steps.push_back(s.steps[hi - 1]);
      d.values.push_back(kNaN);
    }
  }
  return d;
}

std::string render_report_html(const std::string& title, const std::vector<nlohmann::json>& records,
                               const nlohmann::json& config, const std::string& config_error,
                               int64_t torn_lines, const ReportOptions& options) {
  nlohmann::json data;
  data["title"] = title;
  data["config"] = config;
  data["config_error"] = config_error;

  // Header: records, step range, wall-clock span (from the "time" field MetricsLog writes).
  int64_t step_lo = std::numeric_limits<int64_t>::max(), step_hi = std::numeric_limits<int64_t>::min();
  double t_lo = INFINITY, t_hi = -INFINITY;
  for (const auto& r : records) {
    if (!r.is_object()) continue;
    if (auto s = r.find("step"); s != r.end() && s->is_number_integer()) {
      step_lo = std::min(step_lo, s->get<int64_t>());
      step_hi = std::max(step_hi, s->get<int64_t>());
    }
    if (auto t = r.find("time"); t != r.end() && t->is_number()) {
      t_lo = std::min(t_lo, t->get<double>());
      t_hi = std::max(t_hi, t->get<double>());
    }
  }
  std::string summary = cat(records.size(), " records");
  if (step_lo <= step_hi) summary += cat(", steps ", step_lo, " to ", step_hi);
  if (t_lo <= t_hi)
    summary += cat(", ", format_utc(t_lo), " to ", format_utc(t_hi), " (", format_duration(t_hi - t_lo), ")");
  if (torn_lines > 0) summary += cat(", ", torn_lines, " torn last line skipped");
  data["summary"] = summary;

  nlohmann::json series = nlohmann::json::array();
  for (const MetricSeries& full : extract_series(records)) {
    const MetricSeries s = decimate(full, options.max_points);
    nlohmann::json x = nlohmann::json::array(), y = nlohmann::json::array();
    for (size_t i = 0; i < s.steps.size(); ++i) {
      x.push_back(s.steps[i]);
      y.push_back(number_or_null(s.values[i]));
    }
    series.push_back({{"name", s.name}, {"x", std::move(x)}, {"y", std::move(y)}, {"finite", s.finite},
                      {"non_finite", s.non_finite}, {"decimated", s.steps.size() != full.steps.size()}});
  }
  data["series"] = std::move(series);

  std::ostringstream h;
  h << "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
    << "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
    << "<title>opd report</title>\n<style>" << kStyle << "</style>\n</head>\n<body>\n"
    << "<div id=\"header\"><h1 id=\"title\"></h1><div id=\"summary\"></div>\n"
    << "<details id=\"config-box\" open><summary>config.json</summary><pre id=\"config\"></pre></details>\n"
    << "</div>\n<noscript>This report draws its plots with JavaScript.</noscript>\n"
    << "<div id=\"plots\"></div>\n"
    << "<script type=\"application/json\" id=\"opd-data\">" << embed_json(data) << "</script>\n"
    << "<script>" << kScript << "</script>\n</body>\n</html>\n";
  return h.str();
}

std::string write_report(const std::string& run_dir, const std::string& out, const ReportOptions& options) {
  const fs::path dir(run_dir);
  const fs::path metrics = dir / "metrics.jsonl";
  OPD_CHECK(fs::is_regular_file(metrics), Io, "no metrics.jsonl in ", run_dir,
            " (is it a run directory written by `opd train`?)");
  const std::string path = out.empty() ? (dir / "report.html").string() : out;
  // The page must not replace the run's own files (a mistyped --out RUN/metrics.jsonl did).
  for (const fs::path& own : {metrics, dir / "config.json", dir / "train.log"})
    OPD_CHECK(fs::weakly_canonical(path) != fs::weakly_canonical(own), InvalidArgument,
              "--out ", path, " is the run's own ", own.filename().string(),
              "; write the report elsewhere (default: ", (dir / "report.html").string(), ")");
  int64_t torn = 0;
  const std::vector<nlohmann::json> records = MetricsLog::read(metrics.string(), &torn);
  if (torn > 0)
    log_warn(metrics.string(), ": a torn last line (a write cut short) is left out of the report");
  int64_t stepless = 0;
  for (const nlohmann::json& r : records) {
    const auto st = r.find("step");
    stepless += st == r.end() || !st->is_number_integer();
  }
  if (stepless > 0)
    log_warn(metrics.string(), ": ", stepless, " record", stepless > 1 ? "s have" : " has",
             " no integer \"step\" and ", stepless > 1 ? "are" : "is", " not plotted");

  nlohmann::json config = nullptr;
  std::string config_error;
  const fs::path config_path = dir / "config.json";
  if (fs::exists(config_path)) {
    std::string text;
    try {
      text = read_text_file(config_path.string(), int64_t{64} << 20);
      check_json_depth(text, config_path.string());
      config = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    } catch (const Error& e) {
      config = nlohmann::json(nlohmann::json::value_t::discarded);
    }
    if (config.is_discarded()) {
      config = nullptr;
      config_error = "not valid JSON; not shown";
    }
  }
  fs::path canonical = fs::weakly_canonical(dir);
  if (canonical.filename().empty()) canonical = canonical.parent_path();  // "runs/q8/"
  std::string name = canonical.filename().string();
  if (name.empty()) name = run_dir;
  const std::string html = render_report_html("opd run " + name, records, config, config_error, torn, options);
  write_file_atomic(path, html);
  return path;
}

}  // namespace opd
