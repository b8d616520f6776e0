// query_block_place and key_block_place (kernels/block_info.cuh) as the kernels call them: each
// block writes the tile, head and batch entry it is given at its linear index (x fastest), the
// order in which a GPU starts blocks.
#include "block_info.cuh"

extern "C" __global__ void places(int* out, int heads, unsigned heads_magic, int heads_shift, int key_tiles) {
    attn::Params p{};
    p.heads = heads;
    p.heads_magic = heads_magic;
    p.heads_shift = heads_shift;
    const attn::BlockPlace place = key_tiles ? attn::key_block_place(p) : attn::query_block_place(p);
    const int linear = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    if (threadIdx.x == 0) {
        out[3 * linear] = place.tile;
        out[3 * linear + 1] = place.head;
        out[3 * linear + 2] = place.batch;
    }
}

// WorkTiles as the persistent wgmma forward walks it: the launch's blocks start with their own
// work tile of the sectioned grid (pairs, tiles, sections) and claim the rest, each writing the
// place of every work tile it takes at that tile's index and counting its takes in `taken`.
extern "C" __global__ void work_places(int* out, int* taken, unsigned* claims, int heads, unsigned heads_magic,
                                       int heads_shift, int pairs, int tiles, int total) {
    attn::Params p{};
    p.heads = heads;
    p.heads_magic = heads_magic;
    p.heads_shift = heads_shift;
    const attn::WorkTiles work{static_cast<unsigned>(pairs), static_cast<unsigned>(tiles), static_cast<unsigned>(total),
                               claims};
    __shared__ unsigned next;
    for (unsigned w = blockIdx.x; w < work.total;) {
        const attn::BlockPlace place = work.query_place(p, w);
        if (threadIdx.x == 0) {
            out[3 * w] = place.tile;
            out[3 * w + 1] = place.head;
            out[3 * w + 2] = place.batch;
            atomicAdd(taken + w, 1);
            next = work.claim();
        }
        __syncthreads();
        w = next;
        __syncthreads();  // every thread read it before thread 0 claims again
    }
}
