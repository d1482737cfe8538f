// tools/trace_summary.py (the GPU timeline summary used to find idle time between kernels,
// docs/perf.md) on a hand-written trace whose busy time, gaps and segments are known.
#include <gtest/gtest.h>

#include <string>

#include "common/python_oracle.h"
#include "common/test_util.h"

namespace opd::test {
namespace {

std::string summarize(const std::string& csv, const std::string& flags) {
  ScratchDir dir;
  write_file_bytes(dir.file("t.csv"), csv);
  std::string out;
  const int rc = run_python(
      "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')",
      source_dir() + "/tools/trace_summary.py " + flags + " " + dir.file("t.csv"), &out);
  EXPECT_EQ(rc, 0) << out;
  return out;
}

// Segment 0 (times in ns): two overlapping kernels on two streams [1.000, 1.020] ms, a 10 us
// gap with a host sync inside it, a copy [1.030, 1.040], a 1 us gap, a kernel [1.041, 1.042]:
// wall 42 us, busy 31, idle 11. Segment 1 starts after ~8 ms of idle (> --split-ms 2).
const char* kTrace =
    "kind,start,end,stream,name,detail\n"
    "K,1000000,1010000,7,\"_ZN3opd4cuda12_GLOBAL__N_111gemm_kernelILi4EEEvPf\",\"1x1x1/1x1x1 g0\"\n"
    "K,1005000,1020000,8,\"_ZN3opd4cuda12_GLOBAL__N_111gemm_kernelILi4EEEvPf\",\"1x1x1/1x1x1 g0\"\n"
    "M,1030000,1040000,7,\"DtoH\",\"4096\"\n"
    "A,1019000,1031000,0,\"cudaStreamSynchronize\",\"5\"\n"
    "K,1041000,1042000,7,\"rms_kernel\",\"1x1x1/1x1x1 g0\"\n"
    "K,9000000,9003000,7,\"rms_kernel\",\"1x1x1/1x1x1 g0\"\n";

TEST(TraceSummary, BusyIdleAndGapsOfAKnownTimeline) {
  const std::string out = summarize(kTrace, "--min-ms 0 --split-ms 2");
  EXPECT_NE(out.find("segment 0: wall 0.042 ms, busy 0.031 ms, idle 0.011 ms (26.2%), 3 kernels, "
                     "1 copies/memsets"),
            std::string::npos)
      << out;
  // The 10 us gap lies between the second kernel (which ends last) and the copy, with the
  // host's synchronize inside it; the 1 us gap follows the copy.
  EXPECT_NE(out.find("10.0 at    0.020: gemm_kernel -> DtoH 4096 B | cudaStreamSynchronize"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("1.0 at    0.040: DtoH 4096 B -> rms_kernel | -"), std::string::npos) << out;
  EXPECT_NE(out.find("segment 1: wall 0.003 ms, busy 0.003 ms, idle 0.000 ms"), std::string::npos)
      << out;
  EXPECT_NE(out.find("2 segments (2 shown), 5 GPU operations, 1 host records"), std::string::npos)
      << out;
}

TEST(TraceSummary, ShortSegmentsAreCountedButNotShownAndALargerSplitJoinsThem) {
  std::string out = summarize(kTrace, "--min-ms 0.01");
  EXPECT_NE(out.find("2 segments (1 shown)"), std::string::npos) << out;
  EXPECT_EQ(out.find("segment 1:"), std::string::npos) << out;
  out = summarize(kTrace, "--min-ms 0 --split-ms 10");
  EXPECT_NE(out.find("1 segments (1 shown)"), std::string::npos) << out;
  EXPECT_NE(out.find("segment 0: wall 8.003 ms, busy 0.034 ms"), std::string::npos) << out;
}

}  // namespace
}  // namespace opd::test
