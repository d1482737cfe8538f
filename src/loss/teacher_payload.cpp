// Teacher payload validation (teacher_payload.h): structure, alignment with the completion,
// vocabulary policy, and per-row checks of ids and log-probabilities, then the dense [rows, K]
// form with ClipToStudent renormalization a_k -= log1p(-dropped mass), each row's entries in
// the canonical order (logprob descending, ties by smaller id).
#include "loss/teacher_payload.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <mutex>
#include <utility>

#include "core/error.h"
#include "core/thread_pool.h"

namespace opd {

namespace {

constexpr const char* kWhat = "teacher payload";

// "sequence 3, position 17 (row 41)"
std::string where(int64_t seq, int64_t position, int64_t row) {
  return cat("sequence ", seq, ", position ", position, " (row ", row, ")");
}

void check_offsets(const std::vector<int64_t>& offsets, size_t expected_size, int64_t end,
                   const char* name, const char* count_name) {
  OPD_CHECK(offsets.size() == expected_size, InvalidData, kWhat, ": ", name, " has ",
            offsets.size(), " entries, expected ", count_name, " + 1 = ", expected_size);
  OPD_CHECK(offsets.front() == 0, InvalidData, kWhat, ": ", name, "[0] = ", offsets.front(),
            ", expected 0");
  for (size_t i = 1; i < offsets.size(); ++i) {
    OPD_CHECK(offsets[i] >= offsets[i - 1] && offsets[i] <= end, InvalidData, kWhat, ": ", name,
              "[", i, "] = ", offsets[i], " is not in [", offsets[i - 1], ", ", end,
              "] (offsets must be non-decreasing and within the array)");
  }
  OPD_CHECK(offsets.back() == end, InvalidData, kWhat, ": ", name, " ends at ", offsets.back(),
            " but the array has ", end, " entries");
}

}  // namespace

TeacherTopK validate_teacher_payload(const TeacherPayload& pl, const CompletionLayout& layout,
                                     int64_t student_vocab, const LossConfig& config, DType dtype,
                                     PayloadStats* stats_out) {
  OPD_CHECK(dtype == DType::F32 || dtype == DType::F64, InvalidArgument, kWhat,
            ": logprob dtype must be f32 or f64, got ", dtype_name(dtype));
  OPD_CHECK(student_vocab > 0, InvalidArgument, kWhat, ": student vocabulary ", student_vocab,
            " must be > 0");
  OPD_CHECK(layout.first_position.size() == layout.length.size(), InvalidArgument,
            "completion layout: ", layout.first_position.size(), " first positions for ",
            layout.length.size(), " lengths");
  const size_t num_seqs = layout.length.size();
  int64_t rows = 0;
  for (size_t s = 0; s < num_seqs; ++s) {
    OPD_CHECK(layout.length[s] >= 0 && layout.first_position[s] >= 0, InvalidArgument,
              "completion layout: sequence ", s, " has length ", layout.length[s],
              " and first position ", layout.first_position[s]);
    rows += layout.length[s];
  }
  OPD_CHECK(layout.padding.empty() || static_cast<int64_t>(layout.padding.size()) == rows,
            InvalidArgument, "completion layout: padding mask has ", layout.padding.size(),
            " entries for ", rows, " completion rows");

  // --- header and structure --------------------------------------------------------------
  OPD_CHECK(pl.k >= 0 && pl.k <= student_vocab, InvalidData, kWhat, ": k = ", pl.k,
            " is outside [0, student vocabulary ", student_vocab, "]");
  OPD_CHECK(pl.teacher_vocab > 0, InvalidData, kWhat, ": teacher vocabulary ", pl.teacher_vocab,
            " must be > 0");
  OPD_CHECK(pl.seq_first_position.size() == num_seqs, InvalidData, kWhat, ": has ",
            pl.seq_first_position.size(), " sequences, the completion batch has ", num_seqs);
  OPD_CHECK(pl.seq_row_offsets.size() == num_seqs + 1, InvalidData, kWhat,
            ": seq_row_offsets has ", pl.seq_row_offsets.size(), " entries, expected sequences + 1 = ",
            num_seqs + 1);
  OPD_CHECK(pl.seq_row_offsets.back() == static_cast<int64_t>(pl.actual_logprobs.size()),
            InvalidData, kWhat, ": actual_logprobs has ", pl.actual_logprobs.size(),
            " entries but seq_row_offsets covers ", pl.seq_row_offsets.back(), " rows");
  check_offsets(pl.seq_row_offsets, num_seqs + 1, static_cast<int64_t>(pl.actual_logprobs.size()),
                "seq_row_offsets", "sequences");
  for (size_t s = 0; s < num_seqs; ++s) {
    int64_t scored = pl.seq_row_offsets[s + 1] - pl.seq_row_offsets[s];
    OPD_CHECK(scored == layout.length[s], InvalidData, kWhat, ": sequence ", s, ": teacher scored ",
              scored, " positions, the completion has ", layout.length[s]);
    OPD_CHECK(pl.seq_first_position[s] == layout.first_position[s], InvalidData, kWhat,
              ": sequence ", s, ": teacher positions start at ", pl.seq_first_position[s],
              ", the completion starts at position ", layout.first_position[s]);
  }
  OPD_CHECK(pl.ids.size() == pl.logprobs.size(), InvalidData, kWhat, ": ", pl.ids.size(),
            " ids but ", pl.logprobs.size(), " logprobs");
  check_offsets(pl.entry_offsets, static_cast<size_t>(rows) + 1,
                static_cast<int64_t>(pl.ids.size()), "entry_offsets", "rows");

  // --- vocabulary policy -----------------------------------------------------------------
  const bool clip = config.vocab_policy == VocabPolicy::ClipToStudent;
  OPD_CHECK(pl.teacher_vocab <= student_vocab || clip, InvalidData, kWhat,
            ": teacher vocabulary ", pl.teacher_vocab, " is larger than the student's ",
            student_vocab, " (vocab policy 'error'; 'clip-to-student' drops the extra ids)");

  // --- temperature -----------------------------------------------------------------------
  OPD_CHECK(std::isfinite(pl.temperature) && pl.temperature > 0, InvalidData, kWhat,
            ": temperature ", pl.temperature, " must be finite and > 0");
  double rescale = 1.0;  // topk: a_k * T_p / T, exact after renormalization over the K ids
  if (pl.temperature != config.temperature) {
    OPD_CHECK(config.mode == SupportMode::TopK, InvalidData, kWhat,
              ": log-probabilities at temperature ", pl.temperature,
              " cannot give exact values at the distillation temperature ", config.temperature,
              " for mode ", support_mode_name(config.mode),
              "; use mode topk (renormalizes a_k / T over the K ids) or a teacher that applies T");
    rescale = pl.temperature / config.temperature;
  }

  // --- rows ------------------------------------------------------------------------------
  const int64_t k = pl.k;
  TeacherTopK out;
  out.rows = rows;
  out.k = k;
  out.ids = Tensor::empty({rows, k}, DType::I32);
  out.logprobs = Tensor::empty({rows, k}, dtype);
  out.actual_logprobs = Tensor::empty({rows}, dtype);
  out.valid = Tensor::empty({rows}, DType::I32);
  int32_t* o_ids = out.ids.data<int32_t>();
  int32_t* o_valid = out.valid.data<int32_t>();
  auto put = [&](Tensor& t, int64_t i, double v) {
    if (dtype == DType::F32) t.data<float>()[i] = static_cast<float>(v);
    else t.data<double>()[i] = v;
  };

  PayloadStats stats;
  stats.rows = rows;
  const double max_sum = 1.0 + config.payload_sum_tolerance;
  const double max_logprob = std::log1p(config.payload_sum_tolerance);
  // Rows are independent: they are checked and written in parallel (a W1 payload is 32,768 rows
  // x 64 entries). Each chunk keeps its own statistics and its first error; the error reported
  // is the one of the lowest row, as a sequential pass would report it.
  std::vector<int32_t> row_seq(static_cast<size_t>(rows));
  for (size_t s = 0; s < num_seqs; ++s)
    for (int64_t r = pl.seq_row_offsets[s]; r < pl.seq_row_offsets[s + 1]; ++r)
      row_seq[static_cast<size_t>(r)] = static_cast<int32_t>(s);
  std::mutex merge_mu;
  int64_t error_row = rows;
  std::exception_ptr error;
  auto check_rows = [&](int64_t r0, int64_t r1) {
    PayloadStats local;
    std::vector<std::pair<int64_t, int64_t>> sorted;  // (id, entry index) of one row
    std::vector<int64_t> order;                        // entry indices of one row, canonical
    try {
    for (int64_t r = r0; r < r1; ++r) {
      const size_t s = static_cast<size_t>(row_seq[static_cast<size_t>(r)]);
      const int64_t pos = pl.seq_first_position[s] + (r - pl.seq_row_offsets[s]);
      const bool padding = !layout.padding.empty() && layout.padding[r] != 0;
      const int64_t begin = pl.entry_offsets[r], count = pl.entry_offsets[r + 1] - begin;
      OPD_CHECK(count == k, InvalidData, kWhat, ": ", where(s, pos, r), ": has ", count,
                " entries, expected K = ", k);

      double sum_p = 0, dropped = 0;
      int64_t n_dropped = 0;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t id = pl.ids[begin + j];
        const double a = pl.logprobs[begin + j];
        if (clip) {
          OPD_CHECK(id >= 0 && id < pl.teacher_vocab, InvalidData, kWhat, ": ", where(s, pos, r),
                    ": id ", id, " (entry ", j, ") is outside the teacher vocabulary [0, ",
                    pl.teacher_vocab, ")");
        } else {
          OPD_CHECK(id >= 0 && id < student_vocab, InvalidData, kWhat, ": ", where(s, pos, r),
                    ": id ", id, " (entry ", j, ") is outside the student vocabulary [0, ",
                    student_vocab, ")");
          OPD_CHECK(id < pl.teacher_vocab, InvalidData, kWhat, ": ", where(s, pos, r), ": id ",
                    id, " (entry ", j, ") is outside the teacher vocabulary [0, ",
                    pl.teacher_vocab, ")");
        }
        OPD_CHECK(!std::isnan(a), InvalidData, kWhat, ": ", where(s, pos, r),
                  ": logprob of id ", id, " (entry ", j, ") is NaN");
        OPD_CHECK(a != std::numeric_limits<double>::infinity(), InvalidData, kWhat, ": ",
                  where(s, pos, r), ": logprob of id ", id, " (entry ", j,
                  ") is +inf (limit: log-probabilities are <= 0)");
        OPD_CHECK(a != -std::numeric_limits<double>::infinity() || padding, InvalidData, kWhat,
                  ": ", where(s, pos, r), ": logprob of id ", id, " (entry ", j,
                  ") is -inf in a non-padding row (only rows marked as padding may hold -inf)");
        const double p = std::exp(a);
        sum_p += p;
        if (id >= student_vocab) {  // only reachable under ClipToStudent
          dropped += p;
          ++n_dropped;
        }
      }
      const double ay = pl.actual_logprobs[r];
      OPD_CHECK(!std::isnan(ay) && ay != std::numeric_limits<double>::infinity(), InvalidData,
                kWhat, ": ", where(s, pos, r), ": actual-token logprob ", ay,
                " is not a number <= ", max_logprob);
      if (padding) {
        ++local.padding_rows;
        o_valid[r] = 0;
        for (int64_t j = 0; j < k; ++j) {
          o_ids[r * k + j] = kEmptySlot;
          put(out.logprobs, r * k + j, -std::numeric_limits<double>::infinity());
        }
        put(out.actual_logprobs, r, -std::numeric_limits<double>::infinity());
        continue;
      }
      OPD_CHECK(ay != -std::numeric_limits<double>::infinity() && ay <= max_logprob, InvalidData,
                kWhat, ": ", where(s, pos, r), ": actual-token logprob ", ay,
                " is outside (-inf, ", max_logprob, "] in a non-padding row");
      OPD_CHECK(sum_p <= max_sum, InvalidData, kWhat, ": ", where(s, pos, r),
                ": probabilities of the K entries sum to ", sum_p, " > 1 + tolerance ",
                config.payload_sum_tolerance, " (not a sub-distribution)");

      sorted.clear();
      for (int64_t j = 0; j < k; ++j) sorted.emplace_back(pl.ids[begin + j], j);
      std::sort(sorted.begin(), sorted.end());
      for (size_t j = 1; j < sorted.size(); ++j) {
        OPD_CHECK(sorted[j].first != sorted[j - 1].first, InvalidData, kWhat, ": ",
                  where(s, pos, r), ": id ", sorted[j].first, " is repeated (entries ",
                  sorted[j - 1].second, " and ", sorted[j].second, "; each of the K ids must be distinct)");
      }

      double shift = 0;  // ClipToStudent renormalization: log(mass left in the student vocab)
      if (n_dropped > 0) {
        OPD_CHECK(n_dropped < k, InvalidData, kWhat, ": ", where(s, pos, r), ": all ", k,
                  " ids are >= the student vocabulary ", student_vocab,
                  " (clip-to-student leaves no entry)");
        OPD_CHECK(dropped < 1.0 - 1e-6, InvalidData, kWhat, ": ", where(s, pos, r),
                  ": clip-to-student drops probability mass ", dropped,
                  " (limit 1 - 1e-6), nothing left to renormalize");
        shift = std::log1p(-dropped);
        ++local.clipped_rows;
        local.clipped_ids += n_dropped;
        local.max_clipped_mass = std::max(local.max_clipped_mass, dropped);
      }
      // Canonical order (teacher_payload.h): entry j of the output is the j-th by (logprob
      // descending, id ascending) -- a total order, the ids being distinct. Rows already in it
      // (every opd teacher's) are copied as they are; only the others are sorted.
      order.resize(static_cast<size_t>(k));
      for (int64_t j = 0; j < k; ++j) order[static_cast<size_t>(j)] = j;
      auto before = [&](int64_t x, int64_t y) {
        return canonical_entry_before(pl.logprobs[begin + x], pl.ids[begin + x],
                                      pl.logprobs[begin + y], pl.ids[begin + y]);
      };
      if (!std::is_sorted(order.begin(), order.end(), before)) {
        std::sort(order.begin(), order.end(), before);
        ++local.reordered_rows;
      }
      o_valid[r] = 1;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t e = begin + order[static_cast<size_t>(j)];
        const int64_t id = pl.ids[e];
        if (id >= student_vocab) {
          o_ids[r * k + j] = kEmptySlot;
          put(out.logprobs, r * k + j, -std::numeric_limits<double>::infinity());
        } else {
          o_ids[r * k + j] = static_cast<int32_t>(id);
          put(out.logprobs, r * k + j, (pl.logprobs[e] - shift) * rescale);
        }
      }
      put(out.actual_logprobs, r, (ay - shift) * rescale);
    }
    } catch (const Error&) {
      // Rows before the failing one in this chunk passed; chunks are disjoint and ordered, so
      // the lowest failing chunk holds the lowest failing row.
      std::lock_guard<std::mutex> lock(merge_mu);
      if (r0 < error_row) {
        error_row = r0;
        error = std::current_exception();
      }
      return;
    }
    std::lock_guard<std::mutex> lock(merge_mu);
    stats.padding_rows += local.padding_rows;
    stats.clipped_rows += local.clipped_rows;
    stats.clipped_ids += local.clipped_ids;
    stats.reordered_rows += local.reordered_rows;
    stats.max_clipped_mass = std::max(stats.max_clipped_mass, local.max_clipped_mass);
  };
  parallel_for(rows, check_rows, 256);
  if (error) std::rethrow_exception(error);
  if (stats_out) *stats_out = stats;
  return out;
}

}  // namespace opd
