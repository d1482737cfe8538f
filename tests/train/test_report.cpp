// `opd report`: series extraction (gaps, duplicates, non-numeric keys), decimation, a page with
// no external resources, and headless Chromium (--dump-dom) checking that every plot rendered
// with the expected number of points: normal run, empty file, one step, NaN gaps, many keys.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>

#include "common/test_util.h"
#include "core/error.h"
#include "train/metrics.h"
#include "train/metrics_test_util.h"
#include "train/report.h"

namespace opd {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;
using test::MetricsTempDir;

size_t count_of(const std::string& hay, const std::string& needle) {
  size_t n = 0;
  for (size_t p = hay.find(needle); p != std::string::npos; p = hay.find(needle, p + 1)) ++n;
  return n;
}

TEST(Report, ExtractSeriesKeepsNumericKeysWithGaps) {
  std::vector<json> recs = {
      json{{"step", 2}, {"time", 10.0}, {"loss", 0.5}, {"phase", "train"}, {"ok", true}, {"gn", nullptr}},
      json{{"step", 1}, {"time", 9.0}, {"loss", 0.75}, {"gn", 1.5}, {"only_null", nullptr}},
      json{{"step", 3}, {"loss", nullptr}, {"gn", 2.5}, {"nested", {{"a", 1}}}},
      json{{"step", 2}, {"loss", 0.625}},      // a later line for step 2 wins
      json{{"loss", 9.0}},                     // no step: skipped
      json{{"step", "4"}, {"loss", 9.0}},      // step not an integer: skipped
  };
  const auto series = extract_series(recs);
  ASSERT_EQ(series.size(), 2u);  // gn, loss (sorted); no time/phase/ok/only_null/nested
  EXPECT_EQ(series[0].name, "gn");
  EXPECT_EQ(series[0].steps, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(series[0].values[0], 1.5);
  EXPECT_TRUE(std::isnan(series[0].values[1]));
  EXPECT_EQ(series[0].values[2], 2.5);
  EXPECT_EQ(series[0].finite, 2);
  EXPECT_EQ(series[0].non_finite, 1);
  EXPECT_EQ(series[1].name, "loss");
  EXPECT_EQ(series[1].steps, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(series[1].values[0], 0.75);
  EXPECT_EQ(series[1].values[1], 0.625);
  EXPECT_TRUE(std::isnan(series[1].values[2]));
}

TEST(Report, DecimateKeepsExtremesGapsAndTheBound) {
  MetricSeries s;
  s.name = "loss";
  const int64_t n = 10007;
  for (int64_t i = 0; i < n; ++i) {
    s.steps.push_back(i + 1);
    s.values.push_back(i == 777 ? NAN : std::sin(0.01 * double(i)) + 1e-4 * double(i));
  }
  s.values[5000] = 50.0;   // a spike
  s.values[6000] = -50.0;  // and a dip
  s.finite = n - 1;
  s.non_finite = 1;
  const MetricSeries d = decimate(s, 300);
  EXPECT_LE(d.steps.size(), 300u);
  EXPECT_GE(d.steps.size(), 150u);
  EXPECT_EQ(d.finite, s.finite);
  double mx = -INFINITY, mn = INFINITY;
  int64_t gaps = 0;
  for (size_t i = 0; i < d.values.size(); ++i) {
    if (std::isnan(d.values[i])) { ++gaps; continue; }
    mx = std::max(mx, d.values[i]);
    mn = std::min(mn, d.values[i]);
    if (i) EXPECT_GE(d.steps[i], d.steps[i - 1]);
  }
  EXPECT_EQ(mx, 50.0);
  EXPECT_EQ(mn, -50.0);
  EXPECT_EQ(gaps, 1);
  EXPECT_EQ(decimate(s, 0).steps.size(), size_t(n));       // 0 = keep all
  EXPECT_EQ(decimate(s, n).steps.size(), size_t(n));       // short enough already
}

TEST(Report, PageLoadsNothingAndEscapesScriptEnd) {
  std::vector<json> recs;
  for (int64_t s = 1; s <= 3; ++s) recs.push_back(json{{"step", s}, {"time", 1e9 + s}, {"</script><b>x", 0.5 * s}});
  const json config = {{"teacher_url", "</script>"}, {"lr", 1e-5}};
  const std::string html = render_report_html("opd run t", recs, config, "", 0);
  // Exactly the two script elements end; the key and config value cannot break out.
  EXPECT_EQ(count_of(html, "</script>"), 2u);
  EXPECT_EQ(count_of(html, "\\u003c/script>"), 2u);
  // No external resource of any kind; the only URL is the SVG namespace name.
  for (const char* bad : {"src=", "href=", "<link", "@import", "url(", "<img", "<iframe"})
    EXPECT_EQ(html.find(bad), std::string::npos) << bad;
  EXPECT_EQ(count_of(html, "http"), 1u);
  EXPECT_NE(html.find("http://www.w3.org/2000/svg"), std::string::npos);
}

TEST(Report, WriteReportDefaultsAndErrors) {
  MetricsTempDir dir;
  EXPECT_THROW(write_report(dir.str(), ""), Error);  // no metrics.jsonl
  {
    MetricsLog log(dir.str(), false);
    log.write(1, json{{"loss", 1.0}});
  }
  test::spit(dir.str() + "/config.json", "{not json");
  const std::string path = write_report(dir.str() + "/", "");
  EXPECT_EQ(fs::path(path), fs::path(dir.str() + "/") / "report.html");
  const std::string html = test::slurp(path);
  EXPECT_NE(html.find("not valid JSON"), std::string::npos);
  EXPECT_NE(html.find("opd run " + dir.path.filename().string()), std::string::npos);
  // --out naming the run's own files is refused before anything is written (a mistyped
  // --out RUN/metrics.jsonl replaced the metrics with HTML until session 15).
  const std::string before = test::slurp(dir.str() + "/metrics.jsonl");
  for (const char* own : {"/metrics.jsonl", "/config.json", "/./metrics.jsonl"}) {
    try {
      write_report(dir.str(), dir.str() + own);
      ADD_FAILURE() << own << " overwritten";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find("is the run's own"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(test::slurp(dir.str() + "/metrics.jsonl"), before);
}

TEST(Report, CliWritesTheReport) {
  MetricsTempDir dir;
  {
    MetricsLog log(dir.str(), false);
    for (int64_t s = 1; s <= 3; ++s) log.write(s, json{{"loss", 1.0 / double(s)}});
  }
  const std::string out = dir.str() + "/custom.html";
  const test::ToolRun run = test::run_tool(
      test::sh_quote(test::opd_binary()) + " report " + test::sh_quote(dir.str()) + " --out " + test::sh_quote(out),
      dir.str());
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(run.out, out + "\n");
  EXPECT_TRUE(fs::exists(out));
  EXPECT_FALSE(fs::exists(dir.str() + "/report.html"));
  // A directory without metrics is a clear error, not an empty page.
  MetricsTempDir empty;
  const test::ToolRun bad = test::run_tool(test::sh_quote(test::opd_binary()) + " report " + test::sh_quote(empty.str()),
                                           empty.str());
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("no metrics.jsonl"), std::string::npos) << bad.err;
}

// --- headless Chromium -----------------------------------------------------------------------

struct RenderedPlot {
  std::string rendered;
  int64_t points = -1;
};

// Runs chromium --dump-dom on the page; returns series name -> state and the body counters.
struct Dom {
  std::map<std::string, RenderedPlot> plots;
  int64_t plots_total = -1, plots_rendered = -1;
  std::string text;
};

std::string chromium_path() {
  return test::find_program("OPD_CHROMIUM", {"chromium", "chromium-browser", "google-chrome"});
}

::testing::AssertionResult dump_dom(const std::string& html_path, const std::string& scratch, Dom* dom) {
  const std::string cmd = "timeout 180 " + test::sh_quote(chromium_path()) +
                          " --headless --no-sandbox --disable-gpu --disable-dev-shm-usage --no-first-run"
                          " --user-data-dir=" + test::sh_quote(scratch + "/chromium-profile") +
                          " --dump-dom " + test::sh_quote("file://" + html_path);
  const test::ToolRun run = test::run_tool(cmd, scratch);
  if (run.exit_code != 0 || run.out.empty())
    return ::testing::AssertionFailure() << "chromium exit " << run.exit_code << "\n" << run.err;
  dom->text = run.out;
  const std::regex plot_re("data-series=\"([^\"]*)\" data-rendered=\"([^\"]*)\"(?: data-points=\"([0-9]+)\")?");
  for (std::sregex_iterator it(run.out.begin(), run.out.end(), plot_re), end; it != end; ++it) {
    RenderedPlot p;
    p.rendered = (*it)[2];
    if ((*it)[3].matched) p.points = std::stoll((*it)[3]);
    dom->plots[(*it)[1]] = p;
  }
  std::smatch m;
  if (std::regex_search(run.out, m, std::regex("data-plots=\"([0-9]+)\" data-plots-rendered=\"([0-9]+)\""))) {
    dom->plots_total = std::stoll(m[1]);
    dom->plots_rendered = std::stoll(m[2]);
  }
  return ::testing::AssertionSuccess();
}

#define OPD_REQUIRE_CHROMIUM()                                                                     \
  do {                                                                                             \
    if (chromium_path().empty())                                                                   \
      OPD_SKIP_OR_FAIL_MISSING_TOOL("chromium not found in PATH (Debian package `chromium`, or set " \
                                    "$OPD_CHROMIUM)");                                             \
  } while (0)

TEST(Report, ChromiumRendersEveryPlotWithItsPoints) {
  OPD_REQUIRE_CHROMIUM();
  MetricsTempDir dir;
  std::map<std::string, int64_t> expected;  // series -> finite points
  {
    MetricsLog log(dir.str());
    for (int64_t s = 1; s <= 25; ++s) {
      json r = {{"loss", 2.0 / double(s) + 0.05 * std::sin(double(s))},
                {"jsd", s == 7 || s == 8 ? NAN : 0.1 / std::sqrt(double(s))},  // a two-step gap
                {"lr", s < 5 ? 1e-5 * s / 5.0 : 1e-5},
                {"grad_norm", s == 13 ? INFINITY : 1.0 + 0.01 * double(s * s % 7)},
                {"phase", "train"}, {"finite", true}};
      if (s % 5 == 0) r["eval_accuracy"] = 0.2 + 0.01 * double(s);  // a sparse series
      if (s == 25) r["final_only"] = 3.25;                           // a single point
      log.write(s, r);
    }
    expected = {{"loss", 25}, {"jsd", 23}, {"lr", 25}, {"grad_norm", 24}, {"eval_accuracy", 5}, {"final_only", 1}};
  }
  test::spit(dir.str() + "/config.json", R"({"student": "s", "teacher": "t", "lr": 1e-5, "beta": 0.5})");
  const std::string path = write_report(dir.str(), "");
  Dom dom;
  ASSERT_TRUE(dump_dom(path, dir.str(), &dom));
  EXPECT_EQ(dom.plots_total, int64_t(expected.size()));
  EXPECT_EQ(dom.plots_rendered, int64_t(expected.size()));
  ASSERT_EQ(dom.plots.size(), expected.size()) << dom.text.substr(0, 4000);
  for (const auto& [name, points] : expected) {
    ASSERT_TRUE(dom.plots.count(name)) << name;
    EXPECT_EQ(dom.plots[name].rendered, "1") << name;
    EXPECT_EQ(dom.plots[name].points, points) << name;
  }
  EXPECT_NE(dom.text.find("\"teacher\": \"t\""), std::string::npos);  // config shown
  EXPECT_NE(dom.text.find("<path d=\"M"), std::string::npos);
  EXPECT_NE(dom.text.find("2 non-finite (gaps)"), std::string::npos);  // jsd
}

TEST(Report, ChromiumHandlesEmptySingleStepAndManyKeys) {
  OPD_REQUIRE_CHROMIUM();
  {  // empty metrics.jsonl: a page that says so, zero plots
    MetricsTempDir dir;
    { MetricsLog log(dir.str(), false); }
    Dom dom;
    ASSERT_TRUE(dump_dom(write_report(dir.str(), ""), dir.str(), &dom));
    EXPECT_EQ(dom.plots_total, 0);
    EXPECT_EQ(dom.plots_rendered, 0);
    EXPECT_NE(dom.text.find("No numeric metrics yet."), std::string::npos);
  }
  {  // one step, plus a torn last line; a key that is only NaN draws "no finite values"
    MetricsTempDir dir;
    {
      MetricsLog log(dir.str(), false);
      log.write(0, json{{"loss", 0.693}, {"nan_only", NAN}, {"zero", 0}});
    }
    test::spit(dir.str() + "/metrics.jsonl", test::slurp(dir.str() + "/metrics.jsonl") + "{\"step\":1,");
    Dom dom;
    ASSERT_TRUE(dump_dom(write_report(dir.str(), ""), dir.str(), &dom));
    EXPECT_EQ(dom.plots_total, 2);  // loss, zero (nan_only has no finite value: not a series)
    EXPECT_EQ(dom.plots_rendered, 2);
    EXPECT_EQ(dom.plots["loss"].points, 1);
    EXPECT_EQ(dom.plots["zero"].points, 1);
    EXPECT_NE(dom.text.find("1 torn last line skipped"), std::string::npos);
  }
  {  // many keys, and a series long enough to be decimated
    MetricsTempDir dir;
    {
      MetricsLog log(dir.str(), false);
      for (int64_t s = 1; s <= 600; ++s) {
        json r = json::object();
        for (int k = 0; k < 60; ++k) r["metric_" + std::to_string(k)] = std::cos(0.01 * double(s * (k + 1)));
        log.write(s, r);
      }
    }
    ReportOptions o;
    o.max_points = 300;
    Dom dom;
    ASSERT_TRUE(dump_dom(write_report(dir.str(), "", o), dir.str(), &dom));
    EXPECT_EQ(dom.plots_total, 60);
    EXPECT_EQ(dom.plots_rendered, 60);
    ASSERT_EQ(dom.plots.size(), 60u);
    for (const auto& [name, p] : dom.plots) {
      EXPECT_EQ(p.rendered, "1") << name;
      EXPECT_GE(p.points, 100) << name;
      EXPECT_LE(p.points, 300) << name;
    }
    EXPECT_NE(dom.text.find("600 points, decimated"), std::string::npos);
  }
}

}  // namespace
}  // namespace opd
