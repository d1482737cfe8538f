// The resume policy table (train/resume_policy.h) covers every saved training option exactly
// once, and check_resume_options refuses MustMatch differences (all named at once), warns about
// Warn ones with both values, ignores Free ones and options the checkpoint did not save.
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "core/error.h"
#include "train/resume_policy.h"
#include "train/trainer.h"

namespace opd {
namespace {

TEST(ResumePolicy, EverySavedOptionHasExactlyOneRule) {
  const nlohmann::json saved = TrainOptions{}.to_json();
  std::set<std::string> keys;
  for (const auto& r : resume_option_rules()) {
    EXPECT_TRUE(keys.insert(r.key).second) << r.key << " has two rules";
    EXPECT_TRUE(saved.contains(r.key)) << r.key << " is not a saved option";
    if (r.policy != ResumePolicy::Free) EXPECT_STRNE(r.why, "") << r.key;
  }
  for (const auto& [key, value] : saved.items()) EXPECT_TRUE(keys.count(key)) << key << " has no rule";
}

TEST(ResumePolicy, RefusesWarnsOrIgnoresByTheTable) {
  TrainOptions a;
  const nlohmann::json saved = a.to_json();
  TrainOptions b = a;
  b.learning_rate = 3e-5;
  b.beta = 1;
  b.save_total_limit = 9;      // free
  b.micro_batch_size = 2;      // free
  b.data = {"elsewhere.jsonl"};  // free: the data cursor checks the content
  nlohmann::json old = saved;
  old.erase("lmbda");          // not saved (an older checkpoint): not compared
  b.lmbda = 1;
  const auto w = check_resume_options(old, b.to_json(), "CK");
  ASSERT_EQ(w.size(), 2u);
  EXPECT_EQ(w[0].rfind("resume: --beta was 0.5 in the checkpoint, now 1.0: ", 0), 0u) << w[0];
  EXPECT_EQ(w[1].rfind("resume: --learning-rate was 1e-05 in the checkpoint, now 3e-05: ", 0), 0u) << w[1];
  EXPECT_TRUE(check_resume_options(saved, saved, "CK").empty());

  b.seed = 1;
  b.sft = true;
  try {
    check_resume_options(saved, b.to_json(), "CK");
    ADD_FAILURE() << "a changed seed and objective were accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument);
    const std::string m = e.what();
    EXPECT_EQ(m.rfind("cannot resume from CK: ", 0), 0u) << m;
    EXPECT_NE(m.find("--seed was 42 in the checkpoint, now 1"), std::string::npos) << m;
    EXPECT_NE(m.find("the command was opd train in the checkpoint, now opd sft"), std::string::npos) << m;
    EXPECT_NE(m.find("--student CK --out NEW_DIR"), std::string::npos) << m;
  }
}

// The teacher's identity saved with a checkpoint (session 17): a different weights fingerprint
// under the same --teacher path is warned about naming both; the same, a checkpoint without
// one, or a switch between in-process and served teachers (the options' warnings) says nothing;
// a served teacher is compared by what /v1/models reported, not by its URL.
TEST(ResumePolicy, ATeacherWhoseWeightsChangedIsWarnedNamingBothFingerprints) {
  const std::string fp1(64, 'a'), fp2 = "0123456789abcdef" + std::string(48, 'b');
  const nlohmann::json dir1 = {{"teacher", "/m/t"}, {"weights_fingerprint", fp1}};
  nlohmann::json dir2 = dir1;
  dir2["weights_fingerprint"] = fp2;
  EXPECT_FALSE(check_resume_teacher(dir1, dir1));
  EXPECT_FALSE(check_resume_teacher(nlohmann::json(), dir1));  // older checkpoint
  const auto w = check_resume_teacher(dir1, dir2);
  ASSERT_TRUE(w);
  EXPECT_EQ(*w, "resume: the teacher's weights fingerprint (config.json, safetensors headers and "
                "sampled data) was aaaaaaaaaaaaaaaa (--teacher \"/m/t\") in the checkpoint, now "
                "0123456789abcdef (--teacher \"/m/t\"): its files changed under the same path; "
                "the teacher the student is distilled towards; the resumed run is not the same run");
  nlohmann::json moved = dir2;
  moved["teacher"] = "/m/u";
  ASSERT_TRUE(check_resume_teacher(dir1, moved));
  EXPECT_EQ(check_resume_teacher(dir1, moved)->find("same path"), std::string::npos);
  nlohmann::json copy = dir1;  // the same weights elsewhere: the --teacher option warns, not this
  copy["teacher"] = "/m/copy";
  EXPECT_FALSE(check_resume_teacher(dir1, copy));

  const nlohmann::json url1 = {{"teacher_url", "http://h:1"}, {"model", "t"}, {"vocab_size", 272},
                               {"tokenizer_fingerprint", fp1}, {"weights_fingerprint", fp1}};
  EXPECT_FALSE(check_resume_teacher(dir1, url1));  // kinds differ
  nlohmann::json other_rank = url1;
  other_rank["teacher_url"] = "http://h:2";  // another server of the pool, same model
  EXPECT_FALSE(check_resume_teacher(url1, other_rank));
  nlohmann::json url2 = url1;
  url2["weights_fingerprint"] = fp2;
  url2["model"] = "t2";
  const auto wu = check_resume_teacher(url1, url2);
  ASSERT_TRUE(wu);
  EXPECT_NE(wu->find("reported model \"t\", weights_fingerprint aaaaaaaaaaaaaaaa (http://h:1) in "
                     "the checkpoint, now model \"t2\", weights_fingerprint 0123456789abcdef"),
            std::string::npos)
      << *wu;
  nlohmann::json vllm = url1;  // vLLM reports no weights fingerprint: the rest is compared
  vllm.erase("weights_fingerprint");
  EXPECT_FALSE(check_resume_teacher(url1, vllm));
}

}  // namespace
}  // namespace opd
