// The attention kernels' tiles (paged_attention.cpp, latent_attention.cpp): runs of up to `per_tile`
// consecutive tokens of one sequence, so that a prefill chunk's rows share the loads of its keys and
// every decode token is a tile of its own. Tile i is tokens starts[i] .. starts[i + 1].
#pragma once

#include <stdint.h>

#include <vector>

inline std::vector<int64_t> sequence_runs(const int64_t* seq_of_token, int64_t t, int64_t per_tile) {
  std::vector<int64_t> starts;
  for (int64_t i = 0; i < t;) {
    starts.push_back(i);
    int64_t e = i + 1;
    while (e < t && e - i < per_tile && seq_of_token[e] == seq_of_token[i]) ++e;
    i = e;
  }
  starts.push_back(t);
  return starts;
}
