// The on-policy distillation / SFT loop (see trainer.h for the step, resume and SFT contracts).
#include "train/trainer.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <thread>

#include "core/error.h"
#include "core/text_io.h"
#include "core/log.h"
#include "core/philox.h"
#include "core/thread_pool.h"
#include "data/dataset.h"
#include "data/sampler.h"
#include "dist/bucket_ready.h"  // ZeRO-2: reduce each bucket when the backward finished it
#include "dist/communicator.h"
#include "dist/rendezvous.h"
#include "dist/tcp_store.h"
#include "dist/zero.h"
#include "dist/zero_checkpoint.h"  // sharded checkpoints (save, resume on any world size)
#include "model/offload.h"
#include "kernels/ops.h"
#include "loss/fused_loss.h"
#include "loss/fused_loss_cuda.h"  // teacher_to_device
#include "loss/loss_config.h"
#include "loss/teacher_payload.h"
#include "model/init.h"
#include "model/transformer.h"
#include "model/weights_fingerprint.h"  // the teacher's identity in checkpoints
#include "rollout/engine.h"
#include "teacher/client.h"
#include "teacher/cuda_scorer.h"
#include "teacher/score_plan.h"
#include "teacher/scorer.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/fingerprint.h"
#include "tokenizer/tokenizer.h"
#include "train/checkpoint.h"
#include "train/doctor.h"
#include "train/eval.h"
#include "train/metrics.h"
#include "train/optimizer.h"
#include "train/progress.h"
#include "train/resume_policy.h"
#include "train/schedule.h"
#include "train/signals.h"
#include "train/text_adapters.h"

namespace opd {

namespace fs = std::filesystem;

nlohmann::json TrainOptions::to_json() const {
  return {
      {"student", student}, {"teacher", teacher}, {"teacher_url", teacher_url},
      {"teacher_config", teacher_config}, {"data", data},
      {"eval_data", eval_data}, {"out", out}, {"sft", sft}, {"lmbda", lmbda}, {"seq_kd", seq_kd},
      {"beta", beta}, {"loss_support", loss_support}, {"kd_temperature", kd_temperature},
      {"sft_alpha", sft_alpha}, {"teacher_top_k", teacher_top_k}, {"vocab_policy", vocab_policy},
      {"teacher_timeout_s", teacher_timeout_s}, {"temperature", temperature}, {"top_p", top_p},
      {"top_k", top_k}, {"min_p", min_p}, {"num_generations", num_generations},
      {"max_completion_length", max_completion_length},
      {"max_prompt_length", max_prompt_length}, {"truncation", truncation},
      {"kv_cache_gb", kv_cache_gb}, {"ignore_eos", ignore_eos}, {"device", device},
      {"dtype", dtype}, {"recompute", recompute},
      {"recompute_granularity", recompute_granularity}, {"offload_teacher", offload_teacher},
      {"device_memory_budget_gb", device_memory_budget_gb},
      {"zero_stage", zero_stage}, {"batch_size", batch_size},
      {"micro_batch_size", micro_batch_size}, {"learning_rate", learning_rate},
      {"lr_scheduler_type", lr_scheduler_type}, {"warmup_steps", warmup_steps},
      {"warmup_ratio", warmup_ratio}, {"min_lr_ratio", min_lr_ratio},
      {"weight_decay", weight_decay}, {"adam_beta1", adam_beta1}, {"adam_beta2", adam_beta2},
      {"adam_epsilon", adam_epsilon}, {"max_grad_norm", max_grad_norm},
      {"max_steps", max_steps}, {"num_train_epochs", num_train_epochs}, {"seed", seed},
      {"save_steps", save_steps}, {"save_minutes", save_minutes},
      {"save_total_limit", save_total_limit}, {"resume", resume}, {"eval_steps", eval_steps},
      {"eval_limit", eval_limit}, {"max_bad_steps", max_bad_steps},
      {"logging_steps", logging_steps}, {"tensorboard", tensorboard},
      {"eval_before", eval_before}};
}

std::vector<std::string> split_teacher_urls(const std::string& pool) {
  std::vector<std::string> urls;
  size_t start = 0;
  while (true) {
    const size_t comma = pool.find(',', start);
    std::string u = pool.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    const size_t a = u.find_first_not_of(" \t"), b = u.find_last_not_of(" \t");
    u = a == std::string::npos ? std::string() : u.substr(a, b - a + 1);
    OPD_CHECK(!u.empty(), InvalidArgument, "--teacher-url '", pool, "': entry ", urls.size() + 1,
              " is empty");
    urls.push_back(u);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return urls;
}

void TrainOptions::validate() const {
  auto in = [](double v, double lo, double hi) { return std::isfinite(v) && v >= lo && v <= hi; };
  OPD_CHECK(!student.empty(), InvalidArgument, "--student is required");
  OPD_CHECK(!data.empty(), InvalidArgument, "--data is required (one or more JSONL files)");
  if (sft) {
    OPD_CHECK(teacher.empty() && teacher_url.empty(), InvalidArgument,
              "opd sft trains on dataset completions only: --teacher / --teacher-url not allowed");
  } else {
    OPD_CHECK(teacher.empty() != teacher_url.empty(), InvalidArgument,
              "give exactly one of --teacher DIR (in-process) or --teacher-url URL");
  }
  if (!teacher_url.empty()) split_teacher_urls(teacher_url);
  OPD_CHECK(teacher_config.empty() || !teacher_url.empty(), InvalidArgument,
            "--teacher-config describes a --teacher-url server (an in-process --teacher DIR "
            "describes itself)");
  OPD_CHECK(in(lmbda, 0, 1), InvalidArgument, "--lmbda ", lmbda, " must be in [0, 1]");
  OPD_CHECK(in(beta, 0, 1), InvalidArgument, "--beta ", beta, " must be in [0, 1]");
  OPD_CHECK(std::isfinite(kd_temperature) && kd_temperature > 0, InvalidArgument,
            "--kd-temperature ", kd_temperature, " must be > 0");
  OPD_CHECK(std::isfinite(temperature) && temperature >= 0, InvalidArgument, "--temperature ",
            temperature, " must be >= 0 (0 = greedy)");
  OPD_CHECK(in(sft_alpha, 0, 1e6), InvalidArgument, "--sft-alpha ", sft_alpha, " must be >= 0");
  OPD_CHECK(teacher_top_k >= 1 && teacher_top_k <= 4096, InvalidArgument, "--teacher-top-k ",
            teacher_top_k, " must be in [1, 4096]");
  OPD_CHECK(num_generations >= 1 && num_generations <= 1024, InvalidArgument,
            "--num-generations ", num_generations, " must be in [1, 1024]");
  OPD_CHECK(max_completion_length >= 1, InvalidArgument, "--max-completion-length ",
            max_completion_length, " must be >= 1");
  OPD_CHECK(max_prompt_length >= 0, InvalidArgument, "--max-prompt-length must be >= 0");
  OPD_CHECK(batch_size >= 1, InvalidArgument, "--batch-size ", batch_size, " must be >= 1");
  OPD_CHECK(micro_batch_size >= 1, InvalidArgument, "--micro-batch-size ", micro_batch_size,
            " must be >= 1");
  OPD_CHECK(std::isfinite(learning_rate) && learning_rate >= 0, InvalidArgument,
            "--learning-rate ", learning_rate, " must be >= 0");
  OPD_CHECK(warmup_steps >= 0 && in(warmup_ratio, 0, 1) && in(min_lr_ratio, 0, 1),
            InvalidArgument, "--warmup-steps >= 0, --warmup-ratio and --min-lr-ratio in [0, 1]");
  OPD_CHECK(std::isfinite(max_grad_norm) && max_grad_norm >= 0, InvalidArgument,
            "--max-grad-norm ", max_grad_norm, " must be >= 0");
  OPD_CHECK(max_steps >= 0 && in(num_train_epochs, 0, 1e9), InvalidArgument,
            "--max-steps >= 0 and --num-train-epochs >= 0");
  OPD_CHECK(save_steps >= 0 && in(save_minutes, 0, 1e9) && save_total_limit >= 0,
            InvalidArgument, "--save-steps, --save-minutes and --save-total-limit must be >= 0");
  OPD_CHECK(eval_steps >= 0 && eval_limit >= 0 && max_bad_steps >= 0 && logging_steps >= 1,
            InvalidArgument, "--eval-steps, --eval-limit, --max-bad-steps must be >= 0, "
            "--logging-steps >= 1");
  OPD_CHECK(in(kv_cache_gb, 1e-6, 1e6), InvalidArgument, "--kv-cache-gb ", kv_cache_gb,
            " must be > 0");
  OPD_CHECK(std::isfinite(teacher_timeout_s) && teacher_timeout_s >= 0, InvalidArgument,
            "--teacher-timeout ", teacher_timeout_s, " must be >= 0");
  OPD_CHECK(device == "cpu" || device == "cuda", InvalidArgument, "--device ", device,
            " must be cpu or cuda");
  OPD_CHECK(dtype == "bf16" || dtype == "f32", InvalidArgument, "--dtype ", dtype,
            " must be bf16 or f32");
  OPD_CHECK(zero_stage == 1 || zero_stage == 2, InvalidArgument, "--zero-stage ", zero_stage,
            " must be 1 or 2");
  parse_support_mode(loss_support);
  parse_vocab_policy(vocab_policy);
  parse_lr_schedule(lr_scheduler_type);
  parse_truncation(truncation);
  parse_recompute(recompute_granularity);
  OPD_CHECK(!offload_teacher || (device == "cuda" && !teacher.empty()), InvalidArgument,
            "--offload-teacher needs --device cuda and an in-process --teacher DIR");
  OPD_CHECK(device_memory_budget_gb >= 0 && (device_memory_budget_gb == 0 || device == "cuda"),
            InvalidArgument, "--device-memory-budget ", device_memory_budget_gb,
            " must be >= 0 and needs --device cuda");
  OPD_CHECK(!offload_teacher || loss_support != "full", InvalidArgument,
            "--offload-teacher cannot be used with --loss-support full (the dense teacher runs "
            "inside the training phase, so its weights must stay on the GPU)");
  SamplingParams{temperature, top_p, top_k, min_p, 0}.validate();
}

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Where a step's completions come from.
enum class Source { OnPolicy, Dataset, Teacher };
const char* source_name(Source s) {
  return s == Source::OnPolicy ? "on-policy" : s == Source::Dataset ? "dataset" : "teacher";
}

// One training sequence [prompt | completion].
struct Sequence {
  std::vector<int32_t> ids;
  int64_t prompt_len = 0;
  bool from_dataset = false;  // completion is the dataset's (SFT rows)
  bool truncated = false;     // the completion hit max_completion_length without EOS
  std::vector<double> student_logprobs;  // on-policy: log q(y) at T=1 from the rollout
  std::string source;         // dataset line of the prompt
  int64_t completion_len() const { return static_cast<int64_t>(ids.size()) - prompt_len; }
};

// Philox streams of the loop's random draws (the key separates them from the sampler's).
constexpr uint64_t kLmbdaStream = 0x6c6d6264610000ull;    // "lmbda"
constexpr uint64_t kRolloutStream = 0x726f6c6c6f7574ull;  // "rollout"

uint64_t mix64(uint64_t x) {  // splitmix64 finalizer
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

int64_t peak_rss_bytes() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<int64_t>(ru.ru_maxrss) * 1024;
}

// The one-hot "teacher" of SFT rows: K = 1, the target with logprob 0 (p = 1).
TeacherTopK one_hot_teacher(const std::vector<int32_t>& targets) {
  const int64_t n = static_cast<int64_t>(targets.size());
  TeacherTopK t;
  t.rows = n;
  t.k = 1;
  t.ids = Tensor::from_vector(targets, {n, 1});
  t.logprobs = Tensor::zeros({n, 1}, DType::F32);
  t.actual_logprobs = Tensor::zeros({n}, DType::F32);
  t.valid = Tensor::from_vector(std::vector<int32_t>(n, 1), {n});
  return t;
}

TeacherTopK slice_teacher(const TeacherTopK& t, int64_t begin, int64_t end) {
  TeacherTopK s;
  s.rows = end - begin;
  s.k = t.k;
  s.ids = t.ids.slice_rows(begin, end);
  s.logprobs = t.logprobs.slice_rows(begin, end);
  s.actual_logprobs = t.actual_logprobs.slice_rows(begin, end);
  s.valid = t.valid.slice_rows(begin, end);
  return s;
}

// Entropy of the teacher's K atoms + tail (a lower bound of its full entropy), nats per row.
double teacher_topk_entropy_sum(const TeacherTopK& t) {
  // Rows in parallel (W1: 2.1M exponentials, ~8 ms on one core), summed in row order: the
  // same bits as one pass.
  std::vector<double> per_row(static_cast<size_t>(t.rows));
  const float* lp = t.logprobs.data<float>();
  const int32_t* ids = t.ids.data<int32_t>();
  parallel_for(t.rows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      double mass = 0, h = 0;
      for (int64_t k = 0; k < t.k; ++k) {
        if (ids[r * t.k + k] == kEmptySlot) continue;
        const double a = lp[r * t.k + k];
        const double p = std::exp(a);
        mass += p;
        h -= p * a;
      }
      const double tail = 1 - mass;
      if (tail > 1e-12) h -= tail * std::log(tail);
      per_row[static_cast<size_t>(r)] = h;
    }
  }, 1024);
  double total = 0;
  for (double h : per_row) total += h;
  return total;
}

class Trainer {
 public:
  explicit Trainer(const TrainOptions& o) : o_(o) {}
  TrainResult run();

 private:
  TrainResult run_steps();
  void setup();
  void load_data();
  // The plan's inputs for this run (data loaded; the model's recompute and o_.offload_teacher
  // as they are now).
  MemoryPlanOptions memory_plan_options();
  // --device-memory-budget, or without it the device's memory when the plan exceeds it: sets
  // the student's recompute and o_.offload_teacher to the cheapest setting that fits (before
  // setup_teacher, which offloads the teacher); decides keep_rollout_memory_.
  void fit_memory_budget_or_fail();
  void setup_teacher();
  void check_context_lengths() const;
  void build_optimizer();
  void run_doctor_checks(const ModelSide& teacher);
  // describe_model_dir of the student and the in-process teacher, read once at start-up (the
  // doctor checks and the GPU memory plan both need them).
  const ModelSide& student_side();
  std::optional<ModelSide> student_side_, teacher_side_;
  void resume_if_any();
  // Refuses a checkpoint whose model (its config.json) has other parameter shapes than --student.
  void check_resumed_student(const std::string& checkpoint_dir, const nlohmann::json& saved) const;
  int64_t total_steps() const;
  // picks[j] is the dataset index of the step's global prompt number global_index[j] (the
  // rollout stream key uses it, so a prompt's samples do not depend on the number of ranks).
  std::vector<Sequence> make_sequences(Source source, const std::vector<uint64_t>& picks,
                                       const std::vector<int64_t>& global_index, int64_t step,
                                       double* rollout_s);
  // --seq-kd with --teacher-url: the step's completions generated by the remote teacher
  // (/v1/completions, the in-process rollout's seed and stream keys), retried as scoring is.
  std::vector<Sequence> remote_teacher_sequences(const std::vector<uint64_t>& picks,
                                                 const std::vector<int64_t>& global_index,
                                                 int64_t step);
  uint64_t rollout_seed(int64_t step) const;  // sampling seed of a step's rollout
  static uint64_t rollout_stream_key(const std::vector<int32_t>& prompt, int64_t global_index);
  // Data parallel (world_size > 1; see the top of trainer.h).
  void init_distributed();
  void bind_zero_buffers();
  bool distributed() const { return comm_ != nullptr; }
  bool rank0() const { return env_.rank == 0; }
  // Element-wise sum (or max) over ranks of a few host values; identity in one process.
  std::vector<double> host_sum(std::vector<double> v, const char* what);
  bool any_rank(bool flag, const char* what);
  // The step's teacher scores. The in-process scorer returns once its GPU work and copies are
  // done; its response is then checked and converted (validate_teacher_payload, ~10-20 ms of
  // host work at W1's 2.1M entries) on a helper thread, so the check overlaps the first
  // micro-batch's forward on the GPU: get() joins it (and rethrows its InvalidData). A remote
  // teacher's client validates as it receives, and a CPU student's step checks at once, so
  // their futures are ready.
  std::future<TeacherTopK> score(const std::vector<Sequence>& seqs);
  // Runs `call` (one teacher request), retrying transport failures of a remote teacher with
  // backoff for --teacher-timeout while honouring stop signals.
  template <typename Call>
  auto with_retry(const Call& call) -> decltype(call());
  // The backward of one micro-batch; ZeRO-2: each bucket is reduce-scattered as soon as the
  // backward has finished every parameter in it (overlapping the rest of the backward).
  // ZeRO-2: the step's last micro-batch (`reduce` true) reduce-scatters each bucket as its
  // backward finishes it; earlier micro-batches only accumulate into the local gradients.
  void backward_and_reduce(const Batch& batch, const ForwardCache& cache, const Tensor& dhidden,
                           bool reduce);
  void replay_reductions();  // ZeRO-2, a rank with no micro-batch this step: the same reduces
  dist::BucketReadiness& bucket_readiness();
  std::unique_ptr<dist::BucketReadiness> bucket_ready_;
  // CUDA: the rollout keeps its cached device blocks between rollouts (fit_memory_budget_or_fail
  // decides from the plan and the device's memory; EngineOptions::release_device_memory).
  bool keep_rollout_memory_ = false;
  EngineStats rollout_stats_;  // the last rollout's engine statistics (its time split, for metrics)
  std::vector<int> backward_groups_;  // the order the groups finish in one micro-batch
  // What a failed checkpoint write (an Io error: a full disk, a read-only or vanished folder)
  // does. Periodic: a loud warning naming the file and the cause, training goes on and the next
  // save point retries (the in-memory state is the newest copy of the work; the last complete
  // checkpoint stays untouched and is still what --resume auto picks). Final (end of training, a
  // stop signal): the run fails with the cause and the last complete checkpoint, exit code 1.
  enum class SaveFailure { Warn, Fatal };
  // True when the checkpoint of `step` exists after the call.
  bool save(int64_t step, const char* why, SaveFailure on_failure);
  void write_checkpoint(int64_t step, const char* why);
  // `step`: the step as metrics.jsonl numbers it (1-based).
  void save_bad_batch(int64_t step, const std::vector<Sequence>& seqs, const std::string& why);
  double evaluate(const char* when, int64_t step);

  TrainOptions o_;
  LossConfig loss_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<ChatTemplate> chat_template_;
  std::unique_ptr<TokenizerTextEncoder> encoder_;
  std::unique_ptr<TemplateChatRenderer> renderer_;
  // student_ holds the f32 master weights the optimizer updates (host tensors on the CPU, device
  // tensors on CUDA); compute_ is the bf16 CUDA copy the forward, backward and rollout run on
  // (null when they run on the master weights themselves: CPU, or CUDA in f32).
  std::unique_ptr<Transformer> student_;
  std::unique_ptr<Transformer> compute_;
  Transformer& model() { return compute_ ? *compute_ : *student_; }
  Device device_ = Device::CPU;
  DType compute_dtype_ = DType::F32;
  ModelWeights grads_;
  std::unique_ptr<AdamW> optimizer_;
  std::unique_ptr<Scorer> scorer_;
  // The in-process teacher as a model: seq_kd generation, the full-support loss, and (on CUDA)
  // the scorer's model, one copy shared by all three.
  std::shared_ptr<Transformer> teacher_model_;
  std::unique_ptr<WeightOffload> teacher_offload_;  // --offload-teacher
  std::string teacher_url_;  // this rank's entry of the --teacher-url pool
  // The teacher's identity (train/resume_policy.h check_resume_teacher), saved in every
  // checkpoint and compared on resume; null for SFT.
  nlohmann::json teacher_identity_;
  // Gradient buffers live only through the training phase (single process; ZeRO owns its own).
  void bind_grads();
  void release_grads();
  std::vector<int32_t> student_eos_, teacher_eos_;
  std::unique_ptr<Dataset> data_, eval_data_;
  std::unique_ptr<Sampler> sampler_;
  LrSchedule schedule_;
  std::string ckpt_root_;
  std::map<std::string, std::string> export_files_;  // config + tokenizer files
  std::unique_ptr<MetricsLog> metrics_;
  int64_t step_ = 0, bad_steps_ = 0, tokens_seen_ = 0;
  // CUDA: the largest allocator peak of any phase so far (the peak is reset at each phase start).
  int64_t run_peak_device_ = 0;
  // CUDA: the allocator's peak since the previous call, which starts the next phase (0 on CPU).
  int64_t phase_peak() {
    if (device_ != Device::CUDA) return 0;
    const int64_t p = memory_stats(Device::CUDA).peak;
    run_peak_device_ = std::max(run_peak_device_, p);
    reset_peak_memory(Device::CUDA);
    return p;
  }
  int64_t last_saved_step_ = -1;
  int64_t failed_saves_ = 0;  // periodic saves that failed since the last one that worked
  Clock::time_point last_save_time_ = Clock::now();
  TrainResult result_;
  dist::DistEnv env_;
  std::shared_ptr<dist::Store> store_;
  std::unique_ptr<dist::Communicator> comm_;
  std::unique_ptr<dist::ZeroOptimizer> zero_;  // replaces optimizer_ when distributed
};

std::vector<double> Trainer::host_sum(std::vector<double> v, const char* what) {
  if (!distributed()) return v;
  return store_->all_reduce(std::move(v), dist::HostReduce::Sum, what);
}

bool Trainer::any_rank(bool flag, const char* what) {
  if (!distributed()) return flag;
  return store_->all_reduce({flag ? 1.0 : 0.0}, dist::HostReduce::Max, what)[0] > 0;
}

void Trainer::init_distributed() {
  env_ = dist::dist_env_from_process();
  if (env_.world_size == 1) return;
  const double timeout = dist::dist_timeout_seconds([](const char* k) { return std::getenv(k); });
  store_ = dist::Store::connect(env_, timeout);
  if (device_ == Device::CUDA)
    comm_ = dist::make_nccl_communicator(store_, env_.local_rank, timeout);
  else
    comm_ = dist::make_cpu_communicator(store_);
  OPD_CHECK(o_.batch_size >= env_.world_size, InvalidArgument, "--batch-size ", o_.batch_size,
            " (prompts per step, all ranks together) must be >= the number of ranks ",
            env_.world_size);
  log_info("data parallel: ", env_.describe(), ", ", comm_->backend(), " collectives, ZeRO-",
           o_.zero_stage, ", ", o_.batch_size, " prompts per step over ", env_.world_size, " ranks");
}

// The compute model's parameters and the gradients become views of the ZeRO optimizer's flat
// buffers (its model copy is all-gathered after every step; the backward accumulates into its
// local gradient). The f32 master weights live only in the optimizer's shards from then on.
void Trainer::bind_zero_buffers() {
  Transformer& m = model();
  size_t i = 0;
  m.weights().for_each([&](const std::string&, Tensor& w) { w = zero_->param(i++); });
  if (m.weights().tied) m.weights().lm_head = m.weights().embed_tokens;
  i = 0;
  grads_.for_each([&](const std::string&, Tensor& g) { g = zero_->grad(i++); });
  if (grads_.tied) grads_.lm_head = grads_.embed_tokens;
  if (compute_) {  // drop the separate f32 master copy (the shards hold it now)
    student_->weights().for_each([](const std::string&, Tensor& w) { w = Tensor(); });
    student_->weights().lm_head = Tensor();
  }
}

void Trainer::setup() {
  std::error_code ec;
  fs::create_directories(o_.out, ec);
  OPD_CHECK(!ec, Io, "cannot create output directory ", o_.out, ": ", ec.message());
  {
    const char* r = std::getenv("RANK");
    const std::string rank = r ? r : (std::getenv("SLURM_PROCID") ? std::getenv("SLURM_PROCID") : "0");
    set_log_file(o_.out + (rank == "0" ? std::string("/train.log") : "/train.rank" + rank + ".log"));
  }
  ckpt_root_ = o_.out + "/checkpoints";

  loss_.beta = o_.beta;
  loss_.temperature = o_.kd_temperature;
  loss_.mode = parse_support_mode(o_.loss_support);
  loss_.sft_alpha = o_.sft_alpha;
  loss_.vocab_policy = parse_vocab_policy(o_.vocab_policy);
  if (o_.sft) {  // forward KL to a one-hot teacher over {target, rest} = cross-entropy
    loss_.beta = 0;
    loss_.temperature = 1;
    loss_.mode = SupportMode::TopKTail;
    loss_.sft_alpha = 0;
  }
  OPD_CHECK(loss_.mode != SupportMode::Full || !o_.teacher.empty(), InvalidArgument,
            "--loss-support full needs the teacher's logits: an in-process --teacher DIR");
  check_loss_config(loss_);

  log_info("loading student ", o_.student);
  device_ = o_.device == "cuda" ? Device::CUDA : Device::CPU;
  OPD_CHECK(device_ != Device::CUDA || device_hooks::cuda_device_count() > 0, Unsupported,
            "--device cuda: no usable CUDA device here (",
            device_hooks::cuda_compiled() ? "no GPU or driver" : "a build without CUDA",
            "); use --device cpu");
  compute_dtype_ = device_ == Device::CUDA && o_.dtype == "bf16" ? DType::BF16 : DType::F32;
  init_distributed();  // before anything lands on a GPU: NCCL makes LOCAL_RANK's device current
  student_ = std::make_unique<Transformer>(Transformer::load(o_.student));
  if (device_ == Device::CUDA) {
    Transformer host = std::move(*student_);
    student_ = std::make_unique<Transformer>(host.to(Device::CUDA, DType::F32));
    if (compute_dtype_ != DType::F32)
      compute_ = std::make_unique<Transformer>(host.to(Device::CUDA, compute_dtype_));
  }
  model().set_recompute(o_.recompute ? Recompute::PerLayer
                                     : parse_recompute(o_.recompute_granularity));
  const ModelConfig& sc = student_->config();
  tokenizer_ = std::make_unique<Tokenizer>(Tokenizer::load(o_.student));
  OPD_CHECK(tokenizer_->vocab_size() <= sc.vocab_size, InvalidData, o_.student,
            ": the tokenizer has ", tokenizer_->vocab_size(), " ids but the model's vocab_size is ",
            sc.vocab_size);
  if (has_chat_template(o_.student, *tokenizer_))
    chat_template_ = std::make_unique<ChatTemplate>(ChatTemplate::from_model_dir(o_.student));
  encoder_ = std::make_unique<TokenizerTextEncoder>(*tokenizer_);
  if (chat_template_) renderer_ = std::make_unique<TemplateChatRenderer>(*chat_template_);
  student_eos_ = generation_eos_ids(o_.student, sc, tokenizer_.get());
  OPD_CHECK(!student_eos_.empty(), InvalidData, o_.student,
            ": no EOS id (config.json, generation_config.json or tokenizer_config.json); "
            "completions could never end");
  for (const char* f : {"tokenizer.json", "tokenizer_config.json", "generation_config.json",
                        "special_tokens_map.json", "chat_template.jinja"}) {
    const std::string p = o_.student + "/" + f;
    if (fs::exists(p)) export_files_[f] = read_text_file(p);
  }
  export_files_["config.json"] = model_config_to_json(sc) + "\n";
  log_info("student: ", architecture_name(sc.arch), ", ", sc.num_parameters(), " parameters, ",
           sc.num_hidden_layers, " layers, vocab ", sc.vocab_size);
}

void Trainer::load_data() {
  DatasetOptions d;
  d.chat_template_source = chat_template_source(o_.student);
  d.max_prompt_length = o_.max_prompt_length;
  d.truncation = parse_truncation(o_.truncation);
  d.id_limit = student_->config().vocab_size;
  // On-policy-only runs may use prompt-only lines; anything with dataset completions needs them.
  d.require_completion = o_.sft || o_.lmbda < 1 || o_.sft_alpha > 0;
  if (o_.seq_kd) d.require_completion = o_.sft_alpha > 0;
  data_ = std::make_unique<Dataset>(Dataset::load(o_.data, *encoder_, renderer_.get(), d));
  log_info("data: ", data_->report().summary());
  OPD_CHECK(data_->size() > 0, InvalidData, "no training samples in ", o_.data.front());
  sampler_ = std::make_unique<Sampler>(data_->size(), o_.seed, SampleOrder::Shuffled,
                                       data_->fingerprint());
  if (!o_.eval_data.empty()) {
    DatasetOptions e = d;
    e.require_completion = true;
    eval_data_ = std::make_unique<Dataset>(Dataset::load(o_.eval_data, *encoder_, renderer_.get(), e));
    log_info("eval data: ", eval_data_->report().summary());
  }
}

// Sequences longer than a model's max_position_embeddings run (RoPE has no hard limit, and
// transformers does not refuse them either) but sit at positions the model was not trained on,
// and a vLLM teacher rejects them (max_model_len): said once at start-up, with the numbers.
void Trainer::check_context_lengths() const {
  int64_t longest_prompt = 0, longest_line = 0;
  for (size_t i = 0; i < data_->size(); ++i) {
    const Sample& s = (*data_)[i];
    longest_prompt = std::max(longest_prompt, static_cast<int64_t>(s.prompt_ids.size()));
    longest_line = std::max(  // dataset completions are cut at --max-completion-length
        longest_line, static_cast<int64_t>(s.prompt_ids.size()) +
                          std::min<int64_t>(static_cast<int64_t>(s.completion_ids.size()),
                                            o_.max_completion_length));
  }
  const bool samples = o_.lmbda > 0 || o_.seq_kd;  // completions generated up to the limit
  const int64_t longest =
      std::max(longest_line, samples ? longest_prompt + o_.max_completion_length : 0);
  auto check = [&](const std::string& who, int64_t limit) {
    if (limit > 0 && longest > limit)
      log_warn("context: sequences of up to ", longest, " tokens (longest prompt ",
               longest_prompt, samples ? cat(" + --max-completion-length ", o_.max_completion_length)
                                       : std::string(), ") exceed the ", who,
               "'s max_position_embeddings ", limit, ": positions past it are outside what it was "
               "trained on (a vLLM teacher rejects them); --max-prompt-length caps prompts");
  };
  check("student " + o_.student, student_->config().max_position_embeddings);
  if (scorer_) check("teacher " + (o_.teacher.empty() ? teacher_url_ : o_.teacher),
                     scorer_->info().max_model_len);
}

void Trainer::setup_teacher() {
  if (o_.sft) return;
  const ModelConfig& sc = student_->config();
  const TokenizerFingerprint sfp = tokenizer_fingerprint(o_.student, sc.vocab_size);
  if (!o_.teacher.empty()) {
    log_info("loading teacher ", o_.teacher, " (in-process)");
    if (device_ == Device::CUDA) {
      // One device copy serves the scorer, seq_kd generation and the full-support loss.
      teacher_model_ = std::make_shared<Transformer>(
          Transformer::load(o_.teacher).to(Device::CUDA, compute_dtype_));
      CudaScorer::Options so;
      so.dtype = compute_dtype_;
      scorer_ = std::make_unique<CudaScorer>(
          teacher_model_, describe_teacher(o_.teacher, teacher_model_->config()), so);
    } else {
      scorer_ = make_local_scorer(o_.teacher, device_, compute_dtype_);
    }
    teacher_side_ = describe_model_dir(o_.teacher);
    run_doctor_checks(*teacher_side_);
    const WeightsFingerprint fp = weights_fingerprint(o_.teacher);
    teacher_identity_ = {{"teacher", o_.teacher},
                         {"weights_fingerprint", fp.sha256},
                         {"safetensors_files", fp.files},
                         {"safetensors_bytes", fp.total_bytes}};
    log_info("teacher weights fingerprint ", fp.sha256.substr(0, 16), " (", fp.files,
             " safetensors files, ", static_cast<double>(fp.total_bytes) / (1 << 30), " GiB; ",
             fp.bytes_read / 1024, " KiB read)");
    if (o_.seq_kd || loss_.mode == SupportMode::Full) {
      if (!teacher_model_)
        teacher_model_ = std::make_shared<Transformer>(Transformer::load(o_.teacher));
      teacher_eos_ = generation_eos_ids(o_.teacher, teacher_model_->config(), tokenizer_.get());
    }
    if (o_.offload_teacher) {
      teacher_offload_ = std::make_unique<WeightOffload>(teacher_model_);
      log_info("teacher weights offloaded to pinned host memory (",
               static_cast<double>(teacher_offload_->bytes()) / (1 << 30),
               " GiB, on the GPU only while it scores)");
    }
  } else {
    const std::vector<std::string> pool = split_teacher_urls(o_.teacher_url);
    teacher_url_ = pool[static_cast<size_t>(env_.rank) % pool.size()];
    ClientOptions c;
    c.url = teacher_url_;
    c.student_vocab = sc.vocab_size;
    c.student_fingerprint = sfp.sha256;
    c.loss = loss_;
    std::optional<ModelSide> asserted;  // --teacher-config: what a vLLM server does not report
    if (!o_.teacher_config.empty()) {
      asserted = describe_model_dir(o_.teacher_config);
      c.assume_teacher_vocab = asserted->vocab_size;
      c.assume_teacher_fingerprint = asserted->fingerprint;
    }
    if (o_.teacher_timeout_s > 0) {
      // A server that takes a request and never answers is a teacher that disappeared: one
      // call gives up within --teacher-timeout, and each attempt waits at most half of it, so
      // one lost answer is still asked again (before, 8 attempts x the 600 s read timeout).
      c.deadline_s = o_.teacher_timeout_s;
      c.request_timeout_s = std::min(c.request_timeout_s, o_.teacher_timeout_s / 2);
    }
    // A stop signal abandons a call in flight (ErrorKind::Cancelled) instead of waiting out the
    // attempt (up to 600 s against a teacher that took the request and never answers): the step
    // is abandoned, the last completed one saved. Data parallel, the ranks agree after scoring
    // (run_steps: "teacher call cancelled?"), so one rank's abandoned step is every rank's and
    // all of them save the same step.
    c.should_cancel = [] { return stop_requested() != StopRequest::None; };
    log_info("connecting to teacher ", teacher_url_,
             pool.size() > 1 ? cat(" (rank ", env_.rank, ", entry ",
                                   static_cast<size_t>(env_.rank) % pool.size() + 1, " of ",
                                   pool.size(), " in --teacher-url)")
                             : std::string());
    // A teacher server that is not up yet (started beside the run, still loading its model)
    // is waited for as one that disappears mid-run is: up to --teacher-timeout.
    scorer_ = with_retry([&] { return std::make_unique<TeacherClient>(c); });
    // A server reports vocab, tokenizer, EOS only; --teacher-config describes the rest.
    ModelSide t = asserted ? *asserted : student_side();
    t.where = teacher_url_;
    t.vocab_size = scorer_->info().vocab_size;
    t.fingerprint = scorer_->info().fingerprint;
    if (!asserted || !scorer_->info().eos_token_ids.empty()) t.eos_ids = scorer_->info().eos_token_ids;
    run_doctor_checks(t);
    const TeacherInfo& info = scorer_->info();
    // vLLM reports log-probabilities at temperature 1 only (DESIGN.md "Loss"): refused here,
    // before the first rollout, rather than by the first answer's validation.
    const auto* client = dynamic_cast<const TeacherClient*>(scorer_.get());
    OPD_CHECK(!client || client->api() != TeacherApi::Vllm || loss_.temperature == 1.0 ||
                  loss_.mode == SupportMode::TopK,
              InvalidArgument, "teacher at ", teacher_url_, " is a vLLM server (no opd section in "
              "/v1/models): its log-probabilities at temperature 1 cannot give exact values at the "
              "distillation temperature ", loss_.temperature, " (--kd-temperature) for --loss-support ",
              support_mode_name(loss_.mode), "; accept the approximation with --loss-support topk "
              "(renormalizes a_k / T over the K ids) or use a teacher that applies T (opd serve)");
    teacher_identity_ = {{"teacher_url", teacher_url_},
                         {"model", info.model_name},
                         {"vocab_size", info.vocab_size},
                         {"tokenizer_fingerprint", info.fingerprint}};
    if (!info.weights_fingerprint.empty())
      teacher_identity_["weights_fingerprint"] = info.weights_fingerprint;
  }
}

MemoryPlanOptions Trainer::memory_plan_options() {
  MemoryPlanOptions po;
  po.dtype = compute_dtype_;
  po.recompute = model().recompute();
  po.offload_teacher = o_.offload_teacher;
  po.full_support = !o_.sft && !o_.teacher.empty() && loss_.mode == SupportMode::Full;
  po.world_size = env_.world_size;
  po.zero_stage = distributed() ? static_cast<int>(o_.zero_stage) : 0;
  int64_t longest = 0;
  for (size_t i = 0; i < data_->size(); ++i)
    longest = std::max<int64_t>(longest, (*data_)[i].sequence_length());
  po.micro_batch_tokens = o_.micro_batch_size * (longest + o_.max_completion_length);
  // The rollout allocates only the KV blocks its requests can use: at most this rank's prompts
  // x samples x their longest length (in blocks of 16) x 2 (K, V) x layers x kv heads x D.
  const ModelConfig& sc = student_->config();
  const int64_t local_prompts = (o_.batch_size + env_.world_size - 1) / env_.world_size;
  const int64_t tokens_needed = local_prompts * o_.num_generations *
                                ((longest + o_.max_completion_length + 15) / 16 * 16);
  const int64_t kv_needed = tokens_needed * 2 * sc.num_hidden_layers * sc.num_key_value_heads *
                            sc.head_dim * static_cast<int64_t>(dtype_size(compute_dtype_));
  po.kv_cache_bytes = std::min<int64_t>(static_cast<int64_t>(o_.kv_cache_gb * (1 << 30)), kv_needed);
  if (o_.num_generations > 1 && !o_.teacher.empty()) {  // the scorer may share prompts
    int64_t longest_prompt = 0;
    for (size_t i = 0; i < data_->size(); ++i)
      longest_prompt = std::max<int64_t>(longest_prompt,
                                         static_cast<int64_t>((*data_)[i].prompt_ids.size()));
    po.shared_prompt_tokens = longest_prompt;
    po.shared_completion_tokens = o_.max_completion_length;
    po.shared_group = o_.num_generations;
  }
  return po;
}

void Trainer::fit_memory_budget_or_fail() {
  if (device_ != Device::CUDA) return;
  auto g = [](int64_t b) { return cat(static_cast<double>(b) / (1 << 30), " GiB"); };
  // The in-process teacher's shape (the scorer's batch counts in the scoring phase): its
  // config only (setup_teacher reads the tokenizer files for the doctor checks).
  std::optional<ModelSide> teacher;
  if (!o_.sft && !o_.teacher.empty()) teacher = describe_config(load_model_config(o_.teacher));
  const ModelSide* tm = teacher ? &*teacher : nullptr;
  // Without --device-memory-budget the device is the budget: what this process can still hold
  // (free + what its allocator already reserved, e.g. the student's weights).
  const bool from_device = o_.device_memory_budget_gb <= 0;
  int64_t budget = static_cast<int64_t>(o_.device_memory_budget_gb * (1 << 30));
  std::string source = cat("--device-memory-budget ", o_.device_memory_budget_gb, " GiB");
  if (from_device) {
    const device_hooks::CudaMemoryInfo m = device_hooks::cuda_memory_info();
    if (m.total <= 0) return;
    budget = m.free + m.reserved;
    source = cat("the device's ", g(budget), " available (", g(m.total), " total)");
    const MemoryPlan p = plan_gpu_memory(student_side(), tm, memory_plan_options());
    // The rollout's cached blocks (KV cache, packed weights, step buffers) stay reserved
    // between rollouts when the plan leaves room for them beside the largest phase (10% kept
    // free for the driver and fragmentation): no cudaFree/cudaMalloc per rollout.
    keep_rollout_memory_ = p.peak() + p.rollout <= budget / 10 * 9;
    if (const char* e = std::getenv("OPD_ROLLOUT_KEEP_MEMORY"))  // measurement override
      keep_rollout_memory_ = std::string(e) == "1";
    if (p.peak() <= budget) return;  // the chosen settings fit: nothing to decide
    log_warn("the GPU memory plan (peak ", g(p.peak()), " with recompute ",
             recompute_name(model().recompute()), o_.offload_teacher ? ", teacher offloaded" : "",
             ") exceeds ", source, ": choosing the cheapest setting that fits "
             "(--device-memory-budget GIB sets the budget yourself)");
  }
  const bool can_offload = teacher && loss_.mode != SupportMode::Full;
  MemoryChoice smallest;
  const std::optional<MemoryChoice> c =
      fit_memory_budget(student_side(), tm, memory_plan_options(), can_offload, budget, &smallest);
  if (!c) {
    const MemoryPlan& p = smallest.plan;
    OPD_FAIL(InvalidArgument, source, ": no memory setting fits; the smallest plan (recompute ",
             recompute_name(smallest.recompute), smallest.offload_teacher ? ", teacher offloaded" : "",
             ") peaks at ", g(p.peak()), " (rollout ", g(p.rollout_phase()), ", scoring ",
             g(p.scoring_phase()), ", training ", g(p.training_phase()),
             "); lower --micro-batch-size, --max-completion-length, --batch-size or --kv-cache-gb");
  }
  model().set_recompute(c->recompute);
  o_.offload_teacher = c->offload_teacher;
  o_.recompute = false;  // config.json records the setting chosen
  o_.recompute_granularity = recompute_name(c->recompute);
  log_info(source, ": recompute ", recompute_name(c->recompute),
           c->offload_teacher ? ", teacher offloaded" : "", " (planned peak ", g(c->plan.peak()),
           ")");
}

const ModelSide& Trainer::student_side() {
  if (!student_side_) student_side_ = describe_model_dir(o_.student);
  return *student_side_;
}

void Trainer::run_doctor_checks(const ModelSide& teacher) {
  const ModelSide& student = student_side();
  std::string errors;
  for (const auto& f : check_pair(student, teacher, loss_.vocab_policy == VocabPolicy::ClipToStudent)) {
    if (f.severity == Severity::Warning) log_warn("doctor: ", f.check, ": ", f.message);
    if (f.severity == Severity::Error) errors += cat("\n  ", f.check, ": ", f.message);
  }
  OPD_CHECK(errors.empty(), InvalidData, "teacher ", teacher.where, " and student ", o_.student,
            " are not compatible (`opd doctor` prints every check):", errors);
}

void Trainer::build_optimizer() {
  grads_ = zeros_weights(student_->config(), DType::F32, device_);
  std::vector<OptimParam> params;
  std::vector<Tensor> g, c;
  grads_.for_each([&](const std::string&, Tensor& t) { g.push_back(t); });
  if (compute_) compute_->weights().for_each([&](const std::string&, Tensor& t) { c.push_back(t); });
  size_t i = 0;
  student_->weights().for_each([&](const std::string&, Tensor& w) {
    params.push_back(OptimParam{w, g[i], compute_ ? c[i] : Tensor()});
    ++i;
  });
  AdamWConfig ac;
  ac.beta1 = o_.adam_beta1;
  ac.beta2 = o_.adam_beta2;
  ac.eps = o_.adam_epsilon;
  ac.weight_decay = o_.weight_decay;
  if (distributed()) {
    dist::ZeroConfig zc;
    zc.stage = o_.zero_stage == 2 ? dist::ZeroStage::Two : dist::ZeroStage::One;
    zc.grad_reduce = dist::ReduceOp::Sum;  // the loss is already normalized by all ranks' tokens
    zc.model_dtype = compute_dtype_;
    // Parameters of the flat model copy start on 256-byte boundaries, like separately allocated
    // tensors: cuBLASLt chooses its GEMM kernels by operand alignment up to 256 bytes.
    zc.align = 256 / static_cast<int64_t>(dtype_size(compute_dtype_));
    zc.adamw = ac;
    std::vector<Shape> shapes;
    std::vector<Tensor> masters;
    student_->weights().for_each([&](const std::string&, Tensor& w) {
      shapes.push_back(w.shape());
      masters.push_back(w);
    });
    zero_ = std::make_unique<dist::ZeroOptimizer>(*comm_, shapes, zc);
    zero_->load_weights(masters);
    bind_zero_buffers();
  } else {
    optimizer_ = std::make_unique<AdamW>(std::move(params), ac);
    // The gradients exist only in the training phase (bind_grads), from the first step on: kept
    // from here, they were in the first step's rollout and scoring (+4P bytes: W1's first
    // rollout peaked 2.2 GiB above the later ones, H200 session 8).
    release_grads();
  }
  schedule_.kind = parse_lr_schedule(o_.lr_scheduler_type);
  schedule_.base_lr = o_.learning_rate;
  schedule_.total_steps = total_steps();
  schedule_.warmup_steps =
      o_.warmup_steps > 0 ? o_.warmup_steps
                          : static_cast<int64_t>(std::ceil(o_.warmup_ratio * schedule_.total_steps));
  schedule_.min_lr_ratio = o_.min_lr_ratio;
}

void Trainer::bind_grads() {
  if (zero_ || optimizer_->grads_bound()) return;
  grads_ = zeros_weights(student_->config(), DType::F32, device_);
  std::vector<Tensor> g;
  grads_.for_each([&](const std::string&, Tensor& t) { g.push_back(t); });
  optimizer_->bind_grads(g);
}

// Between steps the f32 gradients (4P bytes) are not needed: dropping them leaves the rollout
// and the teacher's scoring that much more device memory.
void Trainer::release_grads() {
  if (zero_) return;
  optimizer_->release_grads();
  grads_ = ModelWeights{};
}

int64_t Trainer::total_steps() const {
  if (o_.max_steps > 0) return o_.max_steps;
  const double steps = std::ceil(o_.num_train_epochs * static_cast<double>(data_->size()) /
                                 static_cast<double>(o_.batch_size));
  return std::max<int64_t>(1, static_cast<int64_t>(steps));
}

void Trainer::check_resumed_student(const std::string& checkpoint_dir,
                                    const nlohmann::json& saved) const {
  if (!fs::exists(checkpoint_dir + "/config.json")) return;  // the tensors' shapes are checked on reading
  const auto mine = parameter_shapes(student_->config());
  const auto theirs = parameter_shapes(load_model_config(checkpoint_dir));
  std::string diff;
  for (size_t i = 0; i < std::max(mine.size(), theirs.size()) && diff.empty(); ++i) {
    if (i < mine.size() && i < theirs.size() && mine[i] == theirs[i]) continue;
    diff = i < mine.size() && i < theirs.size()
               ? cat(mine[i].first, " is ", shape_str(mine[i].second), " in --student, ",
                     theirs[i].first, " ", shape_str(theirs[i].second), " in the checkpoint")
               : cat("the checkpoint has ", theirs.size(), " parameter tensors, --student ",
                     mine.size());
  }
  if (diff.empty()) return;
  const std::string was = saved.contains("student") ? saved["student"].dump() : "unknown";
  OPD_FAIL(InvalidArgument, "cannot resume from ", checkpoint_dir, ": --student ", o_.student,
           " is not the model the checkpoint trained (", diff, "; --student was ", was,
           " in the checkpoint). Resume with a student of the checkpoint's shape, or start a new "
           "run (another --out)");
}

void Trainer::resume_if_any() {
  std::optional<CheckpointData> ck;
  if (o_.resume == "never") {
    OPD_CHECK(list_checkpoints(ckpt_root_).empty(), InvalidArgument, "--resume never, but ",
              ckpt_root_, " already holds checkpoints; use another --out or --resume auto");
    return;
  }
  // Tensor files stay on disk and are read by byte range below (a rank reads only its shard's
  // part). Every file's SHA-256 is verified first (a corrupt shard is a corrupt checkpoint: auto
  // falls back past it); distributed, the ranks share the hashing and agree on the checkpoint.
  if (distributed()) {
    ck = dist::load_checkpoint_collectively(*store_, ckpt_root_,
                                            o_.resume == "auto" ? std::string() : o_.resume);
  } else if (o_.resume == "auto") {
    ck = load_latest_checkpoint(ckpt_root_, nullptr, {true, false});
  } else {
    OPD_CHECK(fs::is_directory(o_.resume), InvalidArgument, "--resume ", o_.resume,
              ": no such checkpoint directory (--resume takes auto, never or a checkpoint "
              "directory such as ", ckpt_root_, "/step-00000100)");
    ck = load_checkpoint(o_.resume, {true, false});
  }
  if (!ck) return;
  const auto& st = ck->state;
  // state.json is covered by the manifest's SHA-256, so only a hostile writer gets a wrong type
  // here; json::at/value would then throw nlohmann's exceptions, reported as this checkpoint's.
  nlohmann::json saved;
  try {
    saved = st.value("options", nlohmann::json::object());
  } catch (const nlohmann::json::exception& e) {
    OPD_FAIL(InvalidData, "checkpoint ", ck->dir, ": state.json: ", e.what());
  }
  // Settings that changed since the checkpoint: refused or warned about (train/resume_policy.h),
  // before any tensor is read.
  std::vector<std::string> changes = check_resume_options(saved, o_.to_json(), ck->dir);
  // The teacher's weights behind the same --teacher path (or the model behind a --teacher-url).
  if (st.contains("teacher"))
    if (auto w = check_resume_teacher(st["teacher"], teacher_identity_)) changes.push_back(*w);
  check_resumed_student(ck->dir, saved);
  std::vector<std::string> names;
  std::vector<Shape> shapes;
  for (auto& [name, shape] : parameter_shapes(student_->config())) {
    names.push_back(name);
    shapes.push_back(shape);
  }
  if (distributed()) {  // this rank's shard, re-sharded from a checkpoint of any world size
    dist::load_zero_checkpoint(*zero_, *ck, names, shapes);
  } else {
    const dist::ZeroOptimizer::FullState full = dist::read_full_state(*ck, names, shapes);
    size_t i = 0;
    auto& m = optimizer_->exp_avg();
    auto& v = optimizer_->exp_avg_sq();
    student_->weights().for_each([&](const std::string&, Tensor& w) {
      w.copy_from(full.master[i]);
      m[i].copy_from(full.exp_avg[i]);
      v[i].copy_from(full.exp_avg_sq[i]);
      ++i;
    });
    if (compute_) {  // the compute copy follows the restored master weights
      std::vector<Tensor> masters;
      student_->weights().for_each([&](const std::string&, Tensor& w) { masters.push_back(w); });
      size_t j = 0;
      compute_->weights().for_each([&](const std::string&, Tensor& w) { ops::convert(masters[j++], w); });
    }
    optimizer_->set_steps(full.steps);
  }
  try {
    OPD_CHECK(st.contains("sampler"), InvalidData, "checkpoint ", ck->dir, ": state.json has no \"sampler\"");
    try {
      sampler_->restore(st["sampler"]);
    } catch (const Error& e) {
      // The cursor indexes the saved run's data (count, order, SHA-256 of every sample's ids):
      // other data, or the same file edited, cannot continue it.
      if (e.kind() != ErrorKind::InvalidArgument) throw;
      throw Error(e.kind(),
                  cat("cannot resume from ", ck->dir, ": its data cursor does not fit this run's "
                      "data (--data was ", saved.value("data", nlohmann::json::array()).dump(),
                      " in the checkpoint, now ", nlohmann::json(o_.data).dump(), "): ", e.what(),
                      ". Resume with the data the checkpoint was trained on, or start a new run "
                      "from its weights (--student ", ck->dir, " --out NEW_DIR)"));
    }
    step_ = ck->step;
    bad_steps_ = st.value("bad_steps", int64_t{0});
    tokens_seen_ = st.value("tokens_seen", int64_t{0});
  } catch (const nlohmann::json::exception& e) {
    OPD_FAIL(InvalidData, "checkpoint ", ck->dir, ": state.json: ", e.what());
  }
  last_saved_step_ = step_;
  for (const auto& w : changes) log_warn(w);
  if (o_.resume != "auto") {  // a chosen checkpoint: this run's later ones are overwritten as it passes them
    const auto mine = list_checkpoints(ckpt_root_);
    if (!mine.empty() && fs::path(mine.back()).filename() > fs::path(ck->dir).filename())
      log_warn("resume: --resume ", o_.resume, " is at step ", step_, " but ", ckpt_root_,
               " holds later checkpoints (the newest ", mine.back(), "): this run writes over "
               "them as it reaches their steps, and later lines of metrics.jsonl are dropped");
  }
  log_info("resumed from checkpoint step ", step_, " (", ck->dir, ")");
  result_.last_checkpoint = ck->dir;
  const int64_t total = total_steps();
  if (step_ >= total)
    log_warn("the checkpoint is at step ", step_, ", ", step_ > total ? "past" : "at",
             " the run's last step ", total, " (--max-steps / --num-train-epochs): nothing to "
             "train; raise --max-steps to continue");
}

// Backward groups (model/transformer.h GradsReady): 0 the untied lm_head (finished by the loss,
// before the backward), 1 the final norm, 2 + i layer i, 2 + L the embedding.
dist::BucketReadiness& Trainer::bucket_readiness() {
  if (bucket_ready_) return *bucket_ready_;
  const int L = static_cast<int>(student_->config().num_hidden_layers);
  std::vector<int> group_of;
  for (const auto& [name, shape] : parameter_shapes(student_->config())) {
    int g = -1;
    if (name == "lm_head.weight") g = 0;
    else if (name == "model.norm.weight") g = 1;
    else if (name == "model.embed_tokens.weight") g = 2 + L;
    else if (name.rfind("model.layers.", 0) == 0) g = 2 + std::stoi(name.substr(13));
    OPD_CHECK(g >= 0 && g <= 2 + L, InvalidArgument, "ZeRO-2: parameter ", name,
              " belongs to no backward group");
    group_of.push_back(g);
  }
  bucket_ready_ = std::make_unique<dist::BucketReadiness>(zero_->layout(), group_of, L + 3);
  backward_groups_ = {0, 1};
  for (int li = L - 1; li >= 0; --li) backward_groups_.push_back(2 + li);
  backward_groups_.push_back(2 + L);
  return *bucket_ready_;
}

// Test-only (docs/distributed.md): OPD_TEST_ZERO2_REDUCE_ALL=1 reduces every bucket after the
// whole backward instead, the path the overlapped one must match bit for bit.
static bool zero2_reduce_all_for_tests() {
  static const bool on = [] {
    const char* v = std::getenv("OPD_TEST_ZERO2_REDUCE_ALL");
    return v && std::string(v) == "1";
  }();
  return on;
}

void Trainer::backward_and_reduce(const Batch& batch, const ForwardCache& cache,
                                  const Tensor& dhidden, bool reduce_now) {
  if (!zero_ || o_.zero_stage != 2 || !reduce_now)
    return model().backward_hidden(batch, cache, dhidden, grads_);
  if (zero2_reduce_all_for_tests()) {
    model().backward_hidden(batch, cache, dhidden, grads_);
    return zero_->reduce_all();
  }
  dist::BucketReadiness& ready = bucket_readiness();
  ready.reset();
  auto reduce = [&](const std::vector<int>& buckets) {
    for (int b : buckets) zero_->reduce_bucket(b);
  };
  const int L = static_cast<int>(student_->config().num_hidden_layers);
  reduce(ready.finish(0));  // the untied lm_head: the loss wrote its gradient already
  model().backward_hidden(batch, cache, dhidden, grads_, [&](const GradsReady& r) {
    switch (r.part) {
      case GradsReady::Part::FinalNorm: return reduce(ready.finish(1));
      case GradsReady::Part::Layer: return reduce(ready.finish(2 + r.layer));
      case GradsReady::Part::Embedding: return reduce(ready.finish(2 + L));
    }
  });
  reduce(ready.remaining());  // none when every group was reported; kept for safety
}

void Trainer::replay_reductions() {
  if (zero2_reduce_all_for_tests()) return zero_->reduce_all();
  dist::BucketReadiness& ready = bucket_readiness();
  for (int b : ready.order_for(backward_groups_)) zero_->reduce_bucket(b);
}

bool Trainer::save(int64_t step, const char* why, SaveFailure on_failure) {
  if (step == last_saved_step_) return true;
  try {
    write_checkpoint(step, why);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::Io) throw;
    const std::string last =
        result_.last_checkpoint.empty()
            ? std::string("no checkpoint of this run is complete yet")
            : cat("the last complete checkpoint is ", result_.last_checkpoint, " (step ",
                  last_saved_step_, "; --resume auto continues from it)");
    // A sharded save that failed on some rank ends in one outcome every rank learned through
    // the store (dist::CheckpointNotWritten, thrown on every rank at the same collective), so the
    // ranks can go on together. Any other Io error out of a distributed save (a store call failed:
    // a peer died, aborted or timed out) may leave the ranks at different collectives: fatal.
    const bool agreed = dynamic_cast<const dist::CheckpointNotWritten*>(&e) != nullptr;
    if (on_failure == SaveFailure::Fatal || (distributed() && !agreed))
      OPD_FAIL(Io, "the checkpoint of step ", step, " (", why, ") could not be written: ",
               e.what(), "; ", last);
    ++failed_saves_;
    last_save_time_ = Clock::now();  // --save-minutes: retry after the interval, not every step
    log_warn("CHECKPOINT FAILED at step ", step, " (", why, "): ", e.what(), "; ", last,
             ". Training continues and the next save retries (", failed_saves_,
             " failed in a row); free space under ", ckpt_root_, " or the work since then is ",
             "lost if the run ends before a save works");
    return false;
  }
  if (failed_saves_ > 0)
    log_info("checkpoint writing works again after ", failed_saves_, " failed save(s)");
  failed_saves_ = 0;
  return true;
}

void Trainer::write_checkpoint(int64_t step, const char* why) {
  CheckpointData ck;
  ck.step = step;
  ck.state["sampler"] = sampler_->save();
  ck.state["bad_steps"] = bad_steps_;
  ck.state["tokens_seen"] = tokens_seen_;
  ck.state["options"] = o_.to_json();
  if (!teacher_identity_.is_null()) ck.state["teacher"] = teacher_identity_;
  ck.files = export_files_;
  const auto t0 = Clock::now();
  std::string path;
  if (distributed()) {
    // Sharded (dist/zero_checkpoint.h): every rank writes its own optimizer shard, rank 0 the
    // model export and the manifest; it resumes on any number of ranks.
    std::vector<std::string> names;
    for (const auto& [name, shape] : parameter_shapes(student_->config())) names.push_back(name);
    path = dist::save_zero_checkpoint(*zero_, ckpt_root_, ck, names,
                                      static_cast<int>(o_.save_total_limit));
  } else {
    auto& model = ck.tensor_files["model"];
    auto& opt = ck.tensor_files["optimizer"];
    size_t i = 0;
    const auto& m = optimizer_->exp_avg();
    const auto& v = optimizer_->exp_avg_sq();
    student_->weights().for_each([&](const std::string& name, Tensor& w) {
      // Host copies (no-ops on the CPU backend): the checkpoint writer reads host memory.
      model[name] = w.to(Device::CPU);
      opt["exp_avg." + name] = m[i].to(Device::CPU);
      opt["exp_avg_sq." + name] = v[i].to(Device::CPU);
      ++i;
    });
    ck.state["optimizer_steps"] = optimizer_->steps();
    path = save_checkpoint(ckpt_root_, ck, static_cast<int>(o_.save_total_limit));
  }
  last_saved_step_ = step;
  last_save_time_ = Clock::now();
  result_.last_checkpoint = path;
  log_info("checkpoint ", path, " (", why, ", ", static_cast<int>(seconds_since(t0) * 1000),
           " ms); a Hugging Face model directory");
}

void Trainer::save_bad_batch(int64_t step, const std::vector<Sequence>& seqs,
                             const std::string& why) {
  nlohmann::json j;
  j["step"] = step;
  j["reason"] = why;
  for (const auto& s : seqs)
    j["sequences"].push_back({{"ids", s.ids}, {"prompt_len", s.prompt_len}, {"source", s.source}});
  const std::string dir = o_.out + "/bad_batches";
  const std::string path = dir + "/step-" + std::to_string(step) +
                           (distributed() ? ".rank" + std::to_string(env_.rank) : "") + ".json";
  // The copy is for a post-mortem: failing to write it (a full disk) must not end the run.
  std::error_code ec;
  fs::create_directories(dir, ec);
  try {
    OPD_CHECK(!ec, Io, "cannot create ", dir, ": ", ec.message());
    write_file_atomic(path, j.dump());
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::Io) throw;
    log_warn("step ", step, " skipped: ", why, "; the batch could not be saved: ", e.what());
    return;
  }
  log_warn("step ", step, " skipped: ", why, "; batch saved to ", path);
}

std::vector<Sequence> Trainer::make_sequences(Source source, const std::vector<uint64_t>& picks,
                                              const std::vector<int64_t>& global_index,
                                              int64_t step, double* rollout_s) {
  std::vector<Sequence> seqs;
  if (source == Source::Dataset) {
    for (uint64_t p : picks) {
      const Sample& s = (*data_)[p];
      Sequence q;
      q.ids = s.prompt_ids;
      q.prompt_len = static_cast<int64_t>(s.prompt_ids.size());
      const int64_t n = std::min<int64_t>(static_cast<int64_t>(s.completion_ids.size()),
                                          o_.max_completion_length);
      q.ids.insert(q.ids.end(), s.completion_ids.begin(), s.completion_ids.begin() + n);
      q.truncated = n < static_cast<int64_t>(s.completion_ids.size());
      q.from_dataset = true;
      q.source = s.source;
      seqs.push_back(std::move(q));
    }
    return seqs;
  }
  const auto t0 = Clock::now();
  if (source == Source::Teacher && !teacher_model_) {  // --seq-kd with --teacher-url
    seqs = remote_teacher_sequences(picks, global_index, step);
    *rollout_s += seconds_since(t0);
    return seqs;
  }
  if (source == Source::Teacher && teacher_offload_) teacher_offload_->upload();
  const Transformer& gen_model = source == Source::OnPolicy ? model() : *teacher_model_;
  const auto& eos = source == Source::OnPolicy ? student_eos_ : teacher_eos_;
  std::vector<GenerationRequest> reqs;
  for (size_t i = 0; i < picks.size(); ++i) {
    const Sample& s = (*data_)[picks[i]];
    GenerationRequest r;
    r.prompt = s.prompt_ids;
    r.sampling = SamplingParams{o_.temperature, o_.top_p, o_.top_k, o_.min_p, rollout_seed(step)};
    r.n = source == Source::OnPolicy ? o_.num_generations : 1;
    r.max_new_tokens = o_.max_completion_length;
    r.ignore_eos = o_.ignore_eos;
    r.stream_key = rollout_stream_key(r.prompt, global_index[i]);
    reqs.push_back(std::move(r));
  }
  EngineOptions eo;
  eo.kv_cache_bytes = static_cast<int64_t>(o_.kv_cache_gb * (1 << 30));
  // 2048 (as `opd bench rollout`): W1's 64 prompts prefill in 8 steps, then decode in lockstep;
  // at the default 512 the admissions stagger over 32 steps and the finishes over the last ~30,
  // which run at small, newly captured batch buckets (W1 rollout 1.43 vs 1.38 s, docs/rollout.md).
  eo.max_step_tokens = 2048;
  eo.should_cancel = [] { return stop_requested() != StopRequest::None; };
  eo.release_device_memory = !keep_rollout_memory_;
  RolloutEngine engine(gen_model, eo, eos);
  auto out = engine.generate(reqs);
  rollout_stats_ = engine.stats();
  for (size_t i = 0; i < picks.size(); ++i) {
    const Sample& s = (*data_)[picks[i]];
    for (const auto& smp : out[i].samples) {
      Sequence q;
      q.ids = s.prompt_ids;
      q.prompt_len = static_cast<int64_t>(s.prompt_ids.size());
      q.ids.insert(q.ids.end(), smp.ids.begin(), smp.ids.end());
      q.truncated = smp.finish_reason == FinishReason::Length;
      if (source == Source::OnPolicy) q.student_logprobs = smp.model_logprobs;
      q.source = s.source;
      seqs.push_back(std::move(q));
    }
  }
  *rollout_s += seconds_since(t0);
  return seqs;
}

uint64_t Trainer::rollout_seed(int64_t step) const {
  return mix64(o_.seed ^ mix64(kRolloutStream + static_cast<uint64_t>(step)));
}

// The same prompt drawn twice in one step still gets independent samples.
uint64_t Trainer::rollout_stream_key(const std::vector<int32_t>& prompt, int64_t global_index) {
  return prompt_stream_key(prompt) ^ mix64(static_cast<uint64_t>(global_index) + 1);
}

std::vector<Sequence> Trainer::remote_teacher_sequences(const std::vector<uint64_t>& picks,
                                                        const std::vector<int64_t>& global_index,
                                                        int64_t step) {
  auto* client = dynamic_cast<TeacherClient*>(scorer_.get());
  OPD_CHECK(client != nullptr, Internal, "--seq-kd: no in-process teacher model and no remote "
            "teacher client");
  // The in-process rollout's seed and stream keys: an opd serve teacher draws the samples an
  // in-process teacher would (the keys travel as opd_stream_keys; vLLM ignores them and
  // samples with the seed alone).
  GenerateRequest g;
  for (size_t i = 0; i < picks.size(); ++i) {
    const Sample& s = (*data_)[picks[i]];
    g.prompts.push_back(s.prompt_ids);
    g.stream_keys.push_back(rollout_stream_key(s.prompt_ids, global_index[i]));
  }
  g.max_tokens = o_.max_completion_length;
  g.temperature = o_.temperature;
  g.top_p = o_.top_p;
  g.top_k = o_.top_k;
  g.min_p = o_.min_p;
  g.seed = rollout_seed(step);
  g.ignore_eos = o_.ignore_eos;
  const std::vector<GeneratedCompletion> out = with_retry([&] { return client->generate(g); });
  rollout_stats_ = EngineStats{};  // the teacher's engine runs elsewhere
  std::vector<Sequence> seqs;
  for (size_t i = 0; i < picks.size(); ++i) {
    const Sample& s = (*data_)[picks[i]];
    Sequence q;
    q.ids = s.prompt_ids;
    q.prompt_len = static_cast<int64_t>(s.prompt_ids.size());
    q.ids.insert(q.ids.end(), out[i].ids.begin(), out[i].ids.end());
    q.truncated = !out[i].stopped;
    q.source = s.source;
    seqs.push_back(std::move(q));
  }
  return seqs;
}

template <typename Call>
auto Trainer::with_retry(const Call& call) -> decltype(call()) {
  const auto t0 = Clock::now();
  double delay = 1;
  for (int attempt = 1;; ++attempt) {
    try {
      return call();
    } catch (const Error& e) {
      // Only transport failures are worth waiting for; a bad response or request is not.
      if (e.kind() != ErrorKind::Io || o_.teacher_url.empty()) throw;
      const double waited = seconds_since(t0);
      OPD_CHECK(waited < o_.teacher_timeout_s, Io, "teacher ", teacher_url_,
                " unreachable or not answering for ", static_cast<int64_t>(waited), " s (--teacher-timeout ",
                o_.teacher_timeout_s, " s): ", e.what());
      log_warn("teacher unreachable (attempt ", attempt, ", waited ",
               static_cast<int64_t>(waited), " s of ", o_.teacher_timeout_s,
               "): ", e.what(), "; retrying in ", delay, " s");
      for (double slept = 0; slept < delay; slept += 0.1) {
        if (stop_requested() != StopRequest::None) throw;
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      delay = std::min(delay * 2, 30.0);
    }
  }
}

std::future<TeacherTopK> Trainer::score(const std::vector<Sequence>& seqs) {
  ScoreRequest req;
  for (const auto& s : seqs)
    req.sequences.push_back({s.ids, s.prompt_len, static_cast<int64_t>(s.ids.size())});
  req.k = std::min<int64_t>(o_.teacher_top_k, scorer_->info().vocab_size);
  req.temperature = loss_.temperature;
  req.model_fingerprint = scorer_->info().fingerprint;
  // A remote opd/vLLM teacher's client already validates each response against the student
  // (same vocabulary and loss config): use its result instead of validating twice.
  if (auto* client = dynamic_cast<TeacherClient*>(scorer_.get())) {
    TeacherClient::Validated v = with_retry([&] { return client->score_validated(req); });
    std::promise<TeacherTopK> ready;
    ready.set_value(std::move(v.topk));
    return ready.get_future();
  }
  ScoreResponse resp = with_retry([&] { return scorer_->score(req); });
  const int64_t vocab = student_->config().vocab_size;
  auto check = [req = std::move(req), resp = std::move(resp), vocab, loss = loss_] {
    check_response_matches(resp, req);
    return validate_teacher_payload(to_teacher_payload(resp), completion_layout(req), vocab, loss,
                                    DType::F32, nullptr);
  };
  // Only a GPU forward leaves the host's cores free for the check; a CPU student's forward
  // needs them (a thread per step made the 2-core demo ~8% slower), so it checks here.
  if (device_ == Device::CUDA) return std::async(std::launch::async, std::move(check));
  std::promise<TeacherTopK> ready;
  ready.set_value(check());
  return ready.get_future();
}

double Trainer::evaluate(const char* when, int64_t step) {
  if (!eval_data_) return -1;
  const auto t0 = Clock::now();
  EvalOptions eo;
  eo.max_new_tokens = o_.max_completion_length;
  eo.limit = o_.eval_limit;
  eo.kv_cache_gb = o_.kv_cache_gb;
  // A stop signal abandons the evaluation (it changes nothing the checkpoint holds): with a real
  // model and many eval samples it could otherwise hold the exit past the 60 s promise.
  eo.should_cancel = [] { return stop_requested() != StopRequest::None; };
  EvalResult r;
  try {
    r = evaluate_exact_match(model(), student_eos_, *eval_data_, eo);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::Cancelled) throw;
    log_warn("eval (", when, ", step ", step, ") abandoned: stop requested (", e.what(), ")");
    return -1;
  }
  log_info("eval (", when, ", step ", step, "): exact match ", r.correct, "/", r.total, " = ",
           r.accuracy() * 100, "% (", static_cast<int>(seconds_since(t0) * 1000), " ms)");
  for (const auto& w : r.wrong_examples) log_debug("  wrong: ", w);
  if (metrics_) metrics_->write(step, {{"eval/exact_match", r.accuracy()}, {"eval/samples", r.total}});
  return r.accuracy();
}

TrainResult Trainer::run_steps() {
  install_training_signal_handlers();
  setup();
  load_data();
  fit_memory_budget_or_fail();
  // A stop signal while a remote teacher is being connected to (not up yet, or its /v1/models
  // never answers) abandons the connect: no step runs, the current step is saved as after any
  // stop (step 0 for a new run) and the run exits 0.
  bool teacher_abandoned = false;
  try {
    setup_teacher();
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::Cancelled || stop_requested() == StopRequest::None) throw;
    log_warn("connecting to the teacher abandoned: stop requested (", e.what(), ")");
    teacher_abandoned = true;
  }
  check_context_lengths();
  if (device_ == Device::CUDA) {  // the per-GPU memory plan (opd doctor --device cuda prints it too)
    const std::optional<ModelSide>& tm = teacher_side_;
    const MemoryPlanOptions po = memory_plan_options();
    const MemoryPlan p = plan_gpu_memory(student_side(), tm ? &*tm : nullptr, po);
    auto g = [](int64_t b) { return static_cast<double>(b) / (1 << 30); };
    log_info("GPU memory plan (upper bound): peak ~", g(p.peak()), " GiB = max(rollout ",
             g(p.rollout_phase()), ", scoring ", g(p.scoring_phase()), ", training ",
             g(p.training_phase()), " GiB); always resident ", g(p.resident()),
             " GiB, training activations ", g(p.activations), " GiB (recompute ",
             recompute_name(po.recompute), ") + workspace ", g(p.workspace),
             " GiB, rollout KV + packed weights ", g(p.rollout), " GiB",
             o_.offload_teacher ? ", teacher offloaded" : "");
  }
  build_optimizer();
  resume_if_any();
  // memory/peak_device_bytes is this run's peak (an earlier run in the process does not count).
  if (device_ == Device::CUDA) reset_peak_memory(Device::CUDA);
  run_peak_device_ = 0;
  const int64_t total = total_steps();
  result_.first_step = step_;
  if (rank0()) {  // one writer of the run's files
    nlohmann::json cfg = o_.to_json();
    cfg["total_steps"] = total;
    cfg["loss"] = describe(loss_);
    cfg["world_size"] = env_.world_size;
    remove_stale_temp_files(o_.out + "/config.json");  // a start-up killed mid-write
    write_file_atomic(o_.out + "/config.json", cfg.dump(2) + "\n");
    metrics_ = std::make_unique<MetricsLog>(o_.out, o_.tensorboard);
    metrics_->truncate_after(step_);
  }
  log_info(o_.sft ? "sft" : "distillation", ": ", describe(loss_), ", lmbda ", o_.lmbda,
           ", steps ", step_, " -> ", total, ", batch ", o_.batch_size, " prompts x ",
           o_.num_generations, ", output ", o_.out);
  // No teacher: no step can run. Data parallel, every rank stops if one could not connect (a
  // rank skipping the loop alone would miss the others' collectives).
  if (any_rank(teacher_abandoned, "teacher connect abandoned?")) {
    teacher_abandoned = true;
    result_.stopped_by_signal = true;
  }
  if (o_.eval_before && step_ == 0 && !teacher_abandoned)
    result_.eval_before = evaluate("before training", 0);

  Progress progress(total, step_, rank0() && Progress::stderr_is_tty());
  int hangups_seen = hangups_received();
  const auto run_t0 = Clock::now();
  while (step_ < total && !result_.stopped_by_signal) {
    if (hangups_received() != hangups_seen) {
      hangups_seen = hangups_received();
      log_warn("SIGHUP received (terminal closed?); training continues, log in ", o_.out,
               "/train.log");
    }
    // Ranks agree on stopping (a signal may reach them at different moments), so all of them
    // leave the loop at the same step and take part in the final checkpoint.
    if (any_rank(stop_requested() != StopRequest::None, "stop?")) {
      result_.stopped_by_signal = true;
      break;
    }
    const auto step_t0 = Clock::now();
    const int64_t step = step_;
    // 1. prompts (on a copy of the sampler: an abandoned step consumes nothing)
    Sampler sampler = *sampler_;
    // Every rank draws the same global batch and keeps prompts rank, rank + world, ...
    std::vector<uint64_t> picks;
    std::vector<int64_t> global_index;
    for (int64_t i = 0; i < o_.batch_size; ++i) {
      const uint64_t p = sampler.next();
      if (i % env_.world_size != env_.rank) continue;
      picks.push_back(p);
      global_index.push_back(i);
    }
    // 2. completions
    Source source = Source::Dataset;
    if (!o_.sft) {
      const double u = philox_uniform(o_.seed, kLmbdaStream, static_cast<uint64_t>(step));
      if (u < o_.lmbda) source = Source::OnPolicy;
      else if (o_.seq_kd) source = Source::Teacher;
    }
    double rollout_s = 0, score_s = 0, train_s = 0;
    // Device memory peaks of this step's phases (CUDA; metrics memory/peak_*_bytes).
    int64_t peak_rollout = 0, peak_score = 0, peak_train = 0;
    (void)phase_peak();  // the rollout (or the dataset's completions) starts here
    std::vector<Sequence> seqs;
    bool cancelled = false;
    std::string rollout_error;
    try {
      seqs = make_sequences(source, picks, global_index, step, &rollout_s);
    } catch (const Error& e) {
      if (e.kind() == ErrorKind::Cancelled) {
        cancelled = true;  // the step is abandoned: nothing of it was applied
        log_warn("step ", step + 1, " abandoned (nothing of it applied): ", e.what());
      } else if (e.kind() == ErrorKind::InvalidData && source != Source::Dataset) {
        // The prompts' ids were checked when the data loaded, so this is the model's output
        // (non-finite logits): a bad step like a non-finite loss, not the end of the run.
        rollout_error = e.what();
      } else {
        throw;
      }
    }
    if (any_rank(cancelled || stop_requested() != StopRequest::None, "stop after rollout?")) {
      result_.stopped_by_signal = true;
      break;
    }
    if (any_rank(!rollout_error.empty(), "rollout failed?")) {
      ++bad_steps_;
      std::vector<Sequence> prompts;
      for (uint64_t p : picks) {
        Sequence q;
        q.ids = (*data_)[p].prompt_ids;
        q.prompt_len = static_cast<int64_t>(q.ids.size());
        q.source = (*data_)[p].source;
        prompts.push_back(std::move(q));
      }
      save_bad_batch(step + 1, prompts, rollout_error.empty() ? "another rank's rollout failed"
                                                          : "rollout failed: " + rollout_error);
      OPD_CHECK(bad_steps_ <= o_.max_bad_steps, InvalidData, bad_steps_,
                " bad steps (more than --max-bad-steps ", o_.max_bad_steps, "); the last: ",
                rollout_error.empty() ? "another rank's rollout failed" : rollout_error);
      if (metrics_) metrics_->write(step + 1, {{"skipped", 1}, {"bad_steps", bad_steps_}});
      *sampler_ = sampler;
      ++step_;
      continue;
    }
    std::erase_if(seqs, [](const Sequence& s) { return s.completion_len() == 0; });
    int64_t n_local = 0, truncated = 0;
    for (const auto& s : seqs) {
      n_local += s.completion_len();
      truncated += s.truncated;
    }
    // The loss is the mean over the completion tokens of the whole step, on every rank.
    const auto counts = host_sum({static_cast<double>(n_local), static_cast<double>(truncated),
                                  static_cast<double>(seqs.size())}, "step token counts");
    const int64_t n_total = static_cast<int64_t>(counts[0]);
    truncated = static_cast<int64_t>(counts[1]);
    const int64_t n_seqs = static_cast<int64_t>(counts[2]);
    if (n_total == 0) {
      log_warn("step ", step + 1, ": no completion tokens (every completion empty); skipped");
      *sampler_ = sampler;
      ++step_;
      continue;
    }
    // 3. teacher
    peak_rollout = phase_peak();
    TeacherTopK teacher;
    std::future<TeacherTopK> pending_teacher;  // joined where the first loss needs it
    std::vector<int32_t> all_targets;
    for (const auto& s : seqs)
      all_targets.insert(all_targets.end(), s.ids.begin() + s.prompt_len, s.ids.end());
    const bool full = loss_.mode == SupportMode::Full;
    if (o_.sft) {
      teacher = one_hot_teacher(all_targets);
    } else if (full) {
      // The teacher's hidden states are computed per micro-batch below (dense logits in tiles).
    } else {
      const auto t0 = Clock::now();
      // Its copy is part of the scoring time: layer by layer behind the scorer's forward.
      if (teacher_offload_) teacher_offload_->upload_layered();
      bool score_cancelled = false;
      try {
        pending_teacher = score(seqs);
      } catch (const Error& e) {
        // A stop signal during the call (one process: whatever the call's error; data parallel:
        // only the client's Cancelled, which every rank then agrees on below). Anything else
        // data parallel takes the job down (the last checkpoint is intact).
        if (stop_requested() != StopRequest::None &&
            (!distributed() || e.kind() == ErrorKind::Cancelled)) {
          log_warn("step ", step + 1, " abandoned (nothing of it applied): stop requested while "
                   "the teacher scored it: ", e.what());
          score_cancelled = true;
        } else {
          // A remote teacher's wrong answer (validated in the client) or its absence past
          // --teacher-timeout: say which step, which teacher, and that nothing was applied.
          if (!o_.teacher_url.empty() && e.kind() != ErrorKind::Cancelled)
            throw Error(e.kind(), cat("step ", step + 1, ": scoring by the teacher at ",
                                      teacher_url_, " failed; nothing of this step was applied and "
                                      "the run stops (its checkpoints are intact: the same command "
                                      "resumes from the newest): ", e.what()));
          throw;
        }
      }
      // Only a remote teacher's call can be cancelled, so only then do the ranks meet here.
      if (distributed() && !o_.teacher_url.empty()
              ? any_rank(score_cancelled, "teacher call cancelled?")
              : score_cancelled) {
        if (!score_cancelled)
          log_warn("step ", step + 1, " abandoned (nothing of it applied): another rank's "
                   "teacher call was cancelled by a stop request");
        result_.stopped_by_signal = true;
        break;
      }
      score_s = seconds_since(t0);
    }
    if (teacher_offload_) teacher_offload_->release();  // the training phase has its bytes
    peak_score = phase_peak();
    // 4. micro-batches: forward, fused loss, backward
    bind_grads();
    const auto train_t0 = Clock::now();
    double loss = 0, div_sum = 0, ce_sum = 0;
    int64_t tail_clamped = 0;
    const int64_t H = student_->config().hidden_size;
    int64_t row0 = 0;
    // ZeRO-2 reduce-scatters once per step, bucket by bucket while the last micro-batch's
    // backward runs (the earlier ones accumulate locally: the full local gradient buffer exists
    // anyway, docs/distributed.md, so reducing per micro-batch only multiplied the traffic). A
    // rank with no micro-batch this step replays the same reductions; whether one has none is
    // agreed before any reduction (a host collective in between would meet another rank's
    // reduce-scatter).
    int64_t replays = 0;
    if (zero_ && o_.zero_stage == 2) {
      const double mine = seqs.empty() ? 0.0 : 1.0;
      const double most = store_->all_reduce({mine}, dist::HostReduce::Max, "micro-batches")[0];
      replays = (mine == 0.0 && most > 0.0) ? 1 : 0;
    }
    for (size_t b0 = 0; b0 < seqs.size(); b0 += static_cast<size_t>(o_.micro_batch_size)) {
      const size_t b1 = std::min(seqs.size(), b0 + static_cast<size_t>(o_.micro_batch_size));
      std::vector<std::vector<int32_t>> ids;
      int64_t rows = 0;
      for (size_t b = b0; b < b1; ++b) {
        ids.push_back(seqs[b].ids);
        rows += seqs[b].completion_len();
      }
      Batch batch = make_batch(ids, student_->config().vocab_size);
      ForwardCache cache;
      Tensor hidden = model().forward_hidden(batch, &cache);
      // Row r of the loss predicts completion token p from the hidden state at p - 1.
      Tensor rows_h = Tensor::empty({rows, H}, hidden.dtype(), device_);
      std::vector<int32_t> targets, sft_rows;
      std::vector<int32_t> src_rows;
      const int32_t* cu = batch.cu_seqlens.data<int32_t>();
      for (size_t b = b0; b < b1; ++b) {
        const auto& s = seqs[b];
        for (int64_t p = s.prompt_len; p < static_cast<int64_t>(s.ids.size()); ++p) {
          src_rows.push_back(cu[b - b0] + p - 1);
          targets.push_back(s.ids[p]);
          sft_rows.push_back(s.from_dataset ? 1 : 0);
        }
      }
      // The loss rows and their inverse (-1 = not a loss row), for gather and scatter back.
      std::vector<int32_t> inverse(static_cast<size_t>(hidden.dim(0)), -1);
      for (int64_t r = 0; r < rows; ++r) inverse[src_rows[r]] = static_cast<int32_t>(r);
      const Tensor row_map = Tensor::from_vector(src_rows, {rows}).to(device_);
      const Tensor inverse_map = Tensor::from_vector(inverse, {hidden.dim(0)}).to(device_);
      ops::gather_rows(hidden, row_map, rows_h);
      // The payload check ran beside this forward (score()); its error surfaces here.
      if (pending_teacher.valid()) teacher = pending_teacher.get();
      TeacherTopK t = full ? TeacherTopK{} : slice_teacher(teacher, row0, row0 + rows);
      if (!full && device_ != Device::CPU) t = cuda::teacher_to_device(t, device_);
      FusedLossArgs args;
      if (full) {
        const auto t0 = Clock::now();
        Tensor th = teacher_model_->forward_hidden(batch);
        const int64_t Ht = teacher_model_->config().hidden_size;
        Tensor rows_t = Tensor::empty({rows, Ht}, th.dtype(), device_);
        ops::gather_rows(th, row_map, rows_t);
        args.teacher_hidden = rows_t;
        args.teacher_lm_head = teacher_model_->weights().lm_head;
        score_s += seconds_since(t0);
      }
      args.hidden = rows_h;
      args.lm_head = model().weights().lm_head;
      args.targets = Tensor::from_vector(targets, {rows}).to(device_);
      args.weights = Tensor::from_vector(std::vector<float>(rows, 1.0f), {rows}).to(device_);
      args.sft_rows = Tensor::from_vector(sft_rows, {rows}).to(device_);
      args.teacher = full ? nullptr : &t;
      args.n_total = static_cast<double>(n_total);
      Tensor d_rows = Tensor::empty({rows, H}, DType::F32, device_);
      // The loss accumulates into the lm_head's (tied: the embedding's) gradient: on CUDA it
      // waits for the previous micro-batch's ZeRO-2 reductions, which clear the local buckets.
      if (zero_) zero_->wait_reductions();
      LossResult lr = fused_lm_head_loss(loss_, args, &d_rows, &grads_.lm_head,
                                         kTrainingLossTileBudgetBytes);
      loss += lr.loss;
      div_sum += lr.divergence_sum;
      ce_sum += lr.ce_sum;
      tail_clamped += lr.tail_clamped;
      Tensor dhidden = Tensor::empty(hidden.shape(), DType::F32, device_);
      ops::gather_rows(d_rows, inverse_map, dhidden);  // zero rows outside the loss
      backward_and_reduce(batch, cache, dhidden, b1 == seqs.size());
      row0 += rows;
    }
    for (int64_t k = 0; k < replays; ++k) replay_reductions();  // bucket for bucket, same order
    if (pending_teacher.valid()) teacher = pending_teacher.get();  // a rank without micro-batches
    // 5. update (or skip a non-finite step). Distributed: the loss and the norm are global, so
    // every rank skips or steps alike.
    const double lr_now = schedule_.lr_at(step);
    {
      const auto sums = host_sum({loss, div_sum, ce_sum, static_cast<double>(tail_clamped)},
                                 "step loss");
      loss = sums[0];
      div_sum = sums[1];
      ce_sum = sums[2];
      tail_clamped = static_cast<int64_t>(sums[3]);
    }
    double gnorm = 0;
    bool skipped = false;
    if (zero_) {
      StepReport rep;
      if (!std::isfinite(loss)) zero_->zero_grad();
      else skipped = !zero_->step_if_finite(lr_now, o_.max_grad_norm, &rep);
      gnorm = rep.grad_norm;
      skipped = skipped || !std::isfinite(loss);
    } else {
      StepReport rep;
      // One norm pass: it decides the skip and (when clipping) gives the clip coefficient.
      skipped = !std::isfinite(loss) || !optimizer_->step_if_finite(lr_now, o_.max_grad_norm, &rep);
      gnorm = rep.grad_norm;
      release_grads();  // the next step binds zeroed buffers when its training phase starts
    }
    if (skipped) {
      ++bad_steps_;
      save_bad_batch(step + 1, seqs, cat("non-finite ", std::isfinite(loss) ? "gradient norm " : "loss ",
                                     std::isfinite(loss) ? gnorm : loss));
      OPD_CHECK(bad_steps_ <= o_.max_bad_steps, InvalidData, bad_steps_,
                " non-finite steps (more than --max-bad-steps ", o_.max_bad_steps,
                "); the last batch is in ", o_.out, "/bad_batches");
    }
    train_s = seconds_since(train_t0);
    peak_train = phase_peak();
    *sampler_ = sampler;
    ++step_;
    tokens_seen_ += n_total;
    // 6. metrics, progress, checkpoint, eval
    const double step_s = seconds_since(step_t0);
    nlohmann::json m;
    m["loss"] = loss;
    m["divergence"] = div_sum / static_cast<double>(n_total);
    if (loss_.sft_alpha > 0) m["ce"] = ce_sum / static_cast<double>(n_total);
    m["lr"] = lr_now;
    m["grad_norm"] = gnorm;
    m["source"] = source_name(source);
    m["on_policy"] = source == Source::OnPolicy ? 1 : 0;
    m["completion_tokens"] = n_total;
    m["completion_len_mean"] = static_cast<double>(n_total) / static_cast<double>(n_seqs);
    m["truncated_share"] = static_cast<double>(truncated) / static_cast<double>(n_seqs);
    m["skipped"] = skipped ? 1 : 0;
    if (!o_.sft && !full && n_local > 0) {
      // Rank 0's rows (distributed: a sample of the step).
      m["teacher_entropy_topk"] = teacher_topk_entropy_sum(teacher) / static_cast<double>(n_local);
      if (loss_.mode == SupportMode::TopKTail) m["tail_clamped"] = tail_clamped;
      if (source == Source::OnPolicy) {
        // Reverse KL estimate on the student's own samples: E_q[log q(y) - log p(y)] (T = 1
        // student logprobs from the rollout; exact per token only when the distillation T is 1).
        double rk = 0;
        int64_t r = 0;
        const float* ta = teacher.actual_logprobs.data<float>();
        for (const auto& s : seqs)
          for (double lq : s.student_logprobs) rk += lq - ta[r++];
        m["reverse_kl_estimate"] = rk / static_cast<double>(n_local);
      }
    }
    if (!o_.sft) {
      m["time/score_s"] = score_s;
      m["tokens_per_s/score"] = score_s > 0 ? n_total / score_s : 0;
    }
    m["time/rollout_s"] = rollout_s;
    if (rollout_s > 0) {
      m["tokens_per_s/rollout"] = n_total / rollout_s;
      // Where this rank's rollout went (EngineStats: device time of prefill / decode forward /
      // sampling on CUDA, host scheduling, the synchronization before it, e.g. with the
      // previous step's optimizer work still queued, and the per-rollout fixed costs).
      const EngineStats& es = rollout_stats_;
      m["time/rollout/sync_wait_s"] = es.sync_wait_seconds;
      m["time/rollout/prefill_s"] = es.prefill_seconds;
      m["time/rollout/decode_forward_s"] = es.decode_forward_seconds;
      m["time/rollout/sample_s"] = es.sample_seconds;
      m["time/rollout/host_s"] = es.host_seconds;
      m["time/rollout/fixed_s"] = es.kv_alloc_seconds + es.pack_seconds + es.runner_seconds +
                                  es.capture_seconds + es.teardown_seconds;
    }
    m["time/train_s"] = train_s;
    m["tokens_per_s/train"] = train_s > 0 ? n_total / train_s : 0;
    m["time/step_s"] = step_s;
    if (distributed()) {
      // The phases' spread over the ranks (the other metrics are rank 0's): tells a rank that is
      // slower by itself from a slowdown every rank shares (e.g. W2's 2-rank rollout gap).
      const std::vector<double> mine = {rollout_s, score_s, train_s, step_s,
                                        rollout_stats_.sync_wait_seconds};
      // One round trip: the max of (t, -t) gives the slowest rank's t and the fastest one's.
      std::vector<double> both = mine;
      for (double t : mine) both.push_back(-t);
      both = store_->all_reduce(std::move(both), dist::HostReduce::Max, "phase times");
      const char* names[] = {"rollout_s", "score_s", "train_s", "step_s", "rollout/sync_wait_s"};
      for (size_t i = 0; i < mine.size(); ++i) {
        m[std::string("time/ranks_max/") + names[i]] = both[i];
        m[std::string("time/ranks_min/") + names[i]] = -both[mine.size() + i];
      }
    }
    m["memory/peak_rss_bytes"] = peak_rss_bytes();
    if (device_ == Device::CUDA) {
      // The run's peak so far, and this step's per phase: the rollout (with its KV cache), the
      // teacher's scoring (with its upload under --offload-teacher), the student's training
      // (gradients, activations, the loss's scratch, AdamW): compare with the plan the run
      // logged at start-up (opd doctor --device cuda prints it too).
      m["memory/peak_device_bytes"] = std::max(run_peak_device_, memory_stats(Device::CUDA).peak);
      m["memory/peak_rollout_bytes"] = peak_rollout;
      if (!o_.sft) m["memory/peak_score_bytes"] = peak_score;
      m["memory/peak_train_bytes"] = peak_train;
    }
    m["bad_steps"] = bad_steps_;
    if (distributed()) m["world_size"] = env_.world_size;
    if (metrics_ && (step_ % o_.logging_steps == 0 || step_ == total)) metrics_->write(step_, m);
    result_.last_loss = loss;
    progress.update(step_, {{"loss", cat(loss)}, {"src", source_name(source)}},
                    static_cast<double>(tokens_seen_) / std::max(1e-9, seconds_since(run_t0)));
    if (o_.save_steps > 0 && step_ % o_.save_steps == 0)
      save(step_, "every --save-steps", SaveFailure::Warn);
    else if (any_rank(o_.save_minutes > 0 && seconds_since(last_save_time_) >= o_.save_minutes * 60,
                      "save by time?"))
      save(step_, "every --save-minutes", SaveFailure::Warn);
    if (o_.eval_steps > 0 && step_ % o_.eval_steps == 0 && step_ < total) evaluate("during", step_);
  }
  progress.finish();
  result_.steps = step_;
  result_.bad_steps = bad_steps_;
  if (result_.stopped_by_signal) {
    log_warn("stop requested (", stop_requested() == StopRequest::Interrupt ? "SIGINT" : "SIGTERM",
             "): saving step ", step_, " and exiting");
    save(step_, "stop signal", SaveFailure::Fatal);
    return result_;
  }
  // A periodic save that failed left steps unsaved: the run saves them now even without
  // --save-at-end, and fails when it cannot (exit code 1, not a silent 0).
  if (o_.save_at_end || failed_saves_ > 0)
    save(step_, o_.save_at_end ? "end of training" : "end of training, after a failed save",
         SaveFailure::Fatal);
  if (step_ > result_.first_step || o_.eval_before) result_.eval_after = evaluate("after training", step_);
  const std::string where = result_.last_checkpoint.empty()
                                ? std::string("no checkpoint written (saving is off)")
                                : "checkpoint " + result_.last_checkpoint;
  if (step_ > result_.first_step)
    log_info("done: ", step_, " steps, last loss ", result_.last_loss, ", ", where);
  else
    log_info("done: nothing trained (the run was already at step ", step_, "), ", where);
  return result_;
}

}  // namespace

TrainResult train(const TrainOptions& options) {
  options.validate();
  Trainer t(options);
  return t.run();
}

TrainResult Trainer::run() {
  try {
    return run_steps();
  } catch (const std::exception& e) {
    // Other ranks waiting in a collective learn of it at once instead of after the timeout.
    if (store_) store_->abort(cat("rank ", env_.rank, ": ", e.what()));
    throw;
  }
}

}  // namespace opd
