// `opd report`: a self-contained HTML page of a run's metrics.jsonl, one SVG line plot per
// numeric series (x = step), plus the run's config.json when present. The data is embedded
// as JSON and drawn by an inline script; the page loads nothing (no CDN, fonts or images).
// Each plot element gets data-rendered="1" and data-points="<points drawn>" once drawn, and
// <body> gets data-plots-rendered, so a headless browser can check that every plot rendered.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace opd {

struct ReportOptions {
  // Series longer than this are decimated to min/max pairs per bucket (spikes stay visible),
  // which keeps the page small for long runs. 0 = never decimate.
  int64_t max_points = 4000;
};

// One numeric key of metrics.jsonl over steps, sorted by step (a later line for the same step
// wins). NaN marks a gap: a null (how non-finite numbers are logged) where the key is numeric.
struct MetricSeries {
  std::string name;
  std::vector<int64_t> steps;
  std::vector<double> values;
  int64_t finite = 0;      // finite points before decimation
  int64_t non_finite = 0;  // gaps
};

// Every key (except "step" and "time") with at least one finite number, sorted by name.
// Records without an integer "step" are skipped; strings, booleans, arrays and objects ignored.
std::vector<MetricSeries> extract_series(const std::vector<nlohmann::json>& records);

// Min/max-per-bucket decimation to at most ~max_points points (gaps kept as NaN points).
MetricSeries decimate(const MetricSeries& s, int64_t max_points);

// The whole page. `config` is the run's config.json (null when absent); `config_error` says why
// it could not be read (shown instead). `torn_lines` is reported in the header.
std::string render_report_html(const std::string& title, const std::vector<nlohmann::json>& records,
                               const nlohmann::json& config, const std::string& config_error,
                               int64_t torn_lines, const ReportOptions& options = {});

// Reads RUN_DIR/metrics.jsonl (and config.json), writes the page to `out` (empty: RUN_DIR/
// report.html) atomically, returns the path written. Throws Io when metrics.jsonl is missing.
std::string write_report(const std::string& run_dir, const std::string& out, const ReportOptions& options = {});

}  // namespace opd
