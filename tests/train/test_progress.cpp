// Progress: pure formatting (ETA h:mm:ss, rates, bar, line cut to the terminal width) and the
// redraw/log cadence driven by a fake clock (ETA from the mean step time since first_step).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "train/progress.h"

namespace opd {
namespace {

TEST(Progress, FormatEta) {
  EXPECT_EQ(Progress::format_eta(0), "0:00:00");
  EXPECT_EQ(Progress::format_eta(59.4), "0:00:59");
  EXPECT_EQ(Progress::format_eta(59.6), "0:01:00");
  EXPECT_EQ(Progress::format_eta(3600), "1:00:00");
  EXPECT_EQ(Progress::format_eta(3725), "1:02:05");
  EXPECT_EQ(Progress::format_eta(100 * 3600 + 61), "100:01:01");
  EXPECT_EQ(Progress::format_eta(NAN), "-:--:--");
  EXPECT_EQ(Progress::format_eta(INFINITY), "-:--:--");
  EXPECT_EQ(Progress::format_eta(-1), "-:--:--");
  EXPECT_EQ(Progress::format_eta(1e300), "99999:59:59");  // capped, no overflow
}

TEST(Progress, FormatRate) {
  EXPECT_EQ(Progress::format_rate(0), "0");
  EXPECT_EQ(Progress::format_rate(950.2), "950");
  EXPECT_EQ(Progress::format_rate(999.7), "1.0k");
  EXPECT_EQ(Progress::format_rate(12345), "12.3k");
  EXPECT_EQ(Progress::format_rate(999960), "1.00M");
  EXPECT_EQ(Progress::format_rate(4.56e6), "4.56M");
  EXPECT_EQ(Progress::format_rate(2.5e9), "2.50G");
  EXPECT_EQ(Progress::format_rate(NAN), "-");
}

TEST(Progress, RenderBar) {
  EXPECT_EQ(Progress::render_bar(5, 10, 10), "[#####.....]");
  EXPECT_EQ(Progress::render_bar(0, 10, 4), "[....]");
  EXPECT_EQ(Progress::render_bar(10, 10, 4), "[####]");
  EXPECT_EQ(Progress::render_bar(13, 10, 4), "[####]");  // clamped
  EXPECT_EQ(Progress::render_bar(3, 0, 4), "");           // unknown total
}

TEST(Progress, RenderLineHasEveryPartAndFitsTheTerminal) {
  const ProgressFields fields = {{"loss", "0.412"}, {"jsd", "0.0310"}};
  const std::string line = Progress::render_line(12, 1000, fields, 12345, 5025, 10, 0);
  EXPECT_EQ(line, "[..........]   12/1000  loss 0.412  jsd 0.0310  | 12.3k tok/s  | ETA 1:23:45");
  const std::string cut = Progress::render_line(12, 1000, fields, 12345, 5025, 10, 30);
  EXPECT_EQ(cut.size(), 29u);
  EXPECT_EQ(cut, line.substr(0, 29));
  // No rate when unknown; unknown total: no bar, no ETA.
  EXPECT_EQ(Progress::render_line(7, 0, {}, 0, NAN, 10, 0), "step 7");
  // A cut never splits a UTF-8 sequence.
  EXPECT_EQ(Progress::render_line(1, 0, {{"\xce\xbb", "0.5"}}, 0, NAN, 10, 10), "step 1  ");
  EXPECT_EQ(Progress::render_line(1, 0, {{"\xce\xbb", "0.5"}}, 0, NAN, 10, 11), "step 1  \xce\xbb");
}

TEST(Progress, RenderLogLine) {
  EXPECT_EQ(Progress::render_log_line(120, 1000, {{"loss", "0.5"}}, 950, 60, 30),
            "step 120/1000 (12.0%)  loss 0.5  | 950 tok/s  | elapsed 0:00:30  | ETA 0:01:00");
}

TEST(Progress, RenderLogLineNamesItsUnit) {
  EXPECT_EQ(Progress::render_log_line(3, 4, {{"exact-match", "finished"}}, 0, 1, 2, "samples"),
            "samples 3/4 (75.0%)  exact-match finished  | elapsed 0:00:02  | ETA 0:00:01");
}

struct Fake {
  double t = 0;
  std::vector<std::string> tty, logs;
  ProgressOptions options(double interval = 10) {
    ProgressOptions o;
    o.log_interval_s = interval;
    o.bar_width = 10;
    o.columns = 200;
    o.clock = [this] { return t; };
    o.tty_write = [this](const std::string& s) { tty.push_back(s); };
    o.log_write = [this](const std::string& s) { logs.push_back(s); };
    return o;
  }
};

TEST(Progress, InteractiveRedrawsOneLineWithEtaFromMeanStepTime) {
  Fake f;
  f.t = 100;
  {
    Progress p(10, 0, true, f.options());
    f.t = 110;  // two steps in 10 s: 5 s per step, 8 left
    p.update(2, {{"loss", "1.5"}}, 2000);
    ASSERT_EQ(f.tty.size(), 1u);
    EXPECT_EQ(f.tty[0], "\r[##........]  2/10  loss 1.5  | 2.0k tok/s  | ETA 0:00:40\x1b[K");
    f.t = 150;
    p.update(10, {{"loss", "0.5"}}, 2000);
    EXPECT_NE(f.tty[1].find("ETA 0:00:00"), std::string::npos) << f.tty[1];
    EXPECT_TRUE(f.logs.empty());
    p.finish();
    p.finish();  // idempotent
  }  // and the destructor does not add another newline
  ASSERT_EQ(f.tty.size(), 3u);
  EXPECT_EQ(f.tty[2], "\n");
}

TEST(Progress, ClearErasesTheLineForALogMessage) {
  Fake f;
  {
    Progress p(10, 0, true, f.options());
    p.clear();  // nothing drawn yet: nothing to erase
    EXPECT_TRUE(f.tty.empty());
    f.t = 1;
    p.update(1, {}, 0);
    p.clear();
    ASSERT_EQ(f.tty.size(), 2u);
    EXPECT_EQ(f.tty[1], "\r\x1b[K");
  }  // the line was erased and not redrawn: finish() adds no empty line
  EXPECT_EQ(f.tty.size(), 2u);
  Progress quiet(10, 0, false, f.options());
  quiet.clear();
  EXPECT_EQ(f.tty.size(), 2u);
}

TEST(Progress, EtaAfterResumeCountsOnlyStepsOfThisProcess) {
  Fake f;
  Progress p(200, 100, true, f.options());
  f.t = 30;  // 10 steps in 30 s since resuming at step 100; 90 left
  p.update(110, {}, 0);
  EXPECT_NE(f.tty.back().find("ETA 0:04:30"), std::string::npos) << f.tty.back();
  EXPECT_EQ(f.tty.back().find("tok/s"), std::string::npos);
}

TEST(Progress, EtaUnknownBeforeTheFirstStep) {
  Fake f;
  Progress p(50, 5, true, f.options());
  f.t = 3;
  p.update(5, {}, 0);
  EXPECT_NE(f.tty.back().find("ETA -:--:--"), std::string::npos) << f.tty.back();
}

TEST(Progress, NonInteractiveLogsAtMostEveryIntervalAndAtTheLastStep) {
  Fake f;
  {
    Progress p(30, 0, false, f.options(10));
    for (int64_t s = 1; s <= 30; ++s) {
      f.t = double(s);  // 1 s per step
      p.update(s, {{"loss", std::to_string(s)}}, 100);
    }
    EXPECT_TRUE(f.tty.empty());
    // step 1 (first), 11 (t=11 >= 1+10), 21, and 30 (last step).
    ASSERT_EQ(f.logs.size(), 4u);
    EXPECT_EQ(f.logs[0].rfind("step 1/30 (3.3%)  loss 1", 0), 0u) << f.logs[0];
    EXPECT_EQ(f.logs[1].rfind("step 11/30", 0), 0u) << f.logs[1];
    EXPECT_EQ(f.logs[2].rfind("step 21/30", 0), 0u) << f.logs[2];
    EXPECT_EQ(f.logs[3].rfind("step 30/30 (100.0%)", 0), 0u) << f.logs[3];
    EXPECT_NE(f.logs[3].find("ETA 0:00:00"), std::string::npos) << f.logs[3];
  }
  EXPECT_EQ(f.logs.size(), 4u);  // finish() has nothing new to log
}

TEST(Progress, NonInteractiveFinishLogsAnUnloggedLastState) {
  Fake f;
  {
    Progress p(100, 0, false, f.options(10));
    f.t = 1;
    p.update(1, {}, 0);
    f.t = 2;
    p.update(2, {{"loss", "0.25"}}, 0);  // within the interval: not logged yet
    EXPECT_EQ(f.logs.size(), 1u);
  }  // stopped early (signal, error): the destructor logs where the run got to
  ASSERT_EQ(f.logs.size(), 2u);
  EXPECT_EQ(f.logs[1].rfind("step 2/100 (2.0%)  loss 0.25", 0), 0u) << f.logs[1];
}

TEST(Progress, RejectsNegativeSteps) {
  EXPECT_ANY_THROW(Progress(-1, 0, false));
  EXPECT_ANY_THROW(Progress(10, -1, false));
  (void)Progress::stderr_is_tty();  // callable anywhere (false under ctest)
}

}  // namespace
}  // namespace opd
