// Whole-buffer writes to a file descriptor (EINTR retried, short writes continued), throwing Io
// "write to PATH failed: <errno text>", and the test-only seam that makes chosen writes fail the
// way a full disk does.
//
// Every writer of run state goes through write_fully / pwrite_fully (checkpoints, safetensors,
// metrics.jsonl, TensorBoard events, bad_batches/), so one seam reaches them all.
//
// Fault seam (tests only; CI has no root to mount a small file system):
//   OPD_TEST_WRITE_FAULT="SUBSTR[@N[+]]"   (several separated by ';')
// A write_fully/pwrite_fully call whose path contains SUBSTR is a match; matches are counted per
// spec from 1 in this process. Without @ every match fails; @N fails only the Nth; @N+ the Nth
// and every later one. A failing call first writes half of its buffer for real (a disk that
// fills mid-write) and then fails with ENOSPC. set_write_fault_for_tests() replaces the spec
// (and resets the counts) in-process; "" turns the seam off.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace opd {

void write_fully(int fd, const void* data, size_t n, const std::string& path);
void pwrite_fully(int fd, const void* data, size_t n, uint64_t offset, const std::string& path);

void set_write_fault_for_tests(const std::string& spec);

}  // namespace opd
