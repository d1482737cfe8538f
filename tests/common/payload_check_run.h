// Shared by the CPU and GPU trainer tests: a run whose teacher's payload check must fail.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "core/error.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

namespace opd::test {

// Runs `o` (an in-process teacher from write_teacher_beyond_student_vocab under
// clip-to-student) and expects the payload check's InvalidData ("leaves no entry") to stop it
// at the first step, before any checkpoint.
inline void expect_payload_check_stops_the_run(const TrainOptions& o) {
  try {
    train(o);
    ADD_FAILURE() << "a teacher whose top-K is outside the student's vocabulary must stop the run";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidData) << e.what();
    EXPECT_NE(std::string(e.what()).find("teacher payload"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("leaves no entry"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(list_checkpoints(o.out + "/checkpoints").empty());
}

}  // namespace opd::test
