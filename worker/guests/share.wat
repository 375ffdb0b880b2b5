;; GPU-time sharing guest (twt bench share, tests/supervisor/observe/test_gpu_share.py).
;;   gemm_loop(n, reps) -> i64     allocates A, B, C (n x n float32), fills A and B, then runs
;;                                 C = A @ B reps times; returns the GEMMs that succeeded (the work
;;                                 the guest counts itself); -1 when a buffer cannot be allocated
;;   small_op(n) -> i32            one n x n GEMM on fresh buffers: a latency-sensitive tenant's op
;;   one_gemm(a, b, c, n) -> i32   exactly one device op: C = A @ B on client buffers (n x n)
;;   chatty(ops, spin, device) -> i64   a chatty tenant (an inference loop's shape): ops times a tiny
;;                                 device op (fill_f32 of 64 floats; when device = 0, the control,
;;                                 the same host call with a count of 0: the host's work without
;;                                 the device's) then `spin` iterations of guest arithmetic (host
;;                                 work); returns the loop count (+0 * the arithmetic)
(module
  (import "tensorwasm" "alloc" (func $alloc (param i64) (result i64)))
  (import "tensorwasm" "fill_f32" (func $fill (param i64 f32 i64) (result i32)))
  (import "tensorwasm" "matmul_f32" (func $matmul (param i64 i64 i64 i64 i64 i64) (result i32)))

  (func $buffers (param $n i64) (result i64 i64 i64)
    (local $a i64) (local $b i64) (local $c i64) (local $bytes i64)
    (local.set $bytes (i64.mul (i64.mul (local.get $n) (local.get $n)) (i64.const 4)))
    (local.set $a (call $alloc (local.get $bytes)))
    (local.set $b (call $alloc (local.get $bytes)))
    (local.set $c (call $alloc (local.get $bytes)))
    (drop (call $fill (local.get $a) (f32.const 0.5) (i64.mul (local.get $n) (local.get $n))))
    (drop (call $fill (local.get $b) (f32.const 0.25) (i64.mul (local.get $n) (local.get $n))))
    (local.get $a) (local.get $b) (local.get $c))

  (func (export "gemm_loop") (param $n i64) (param $reps i64) (result i64)
    (local $a i64) (local $b i64) (local $c i64) (local $i i64) (local $done i64)
    (call $buffers (local.get $n))
    (local.set $c) (local.set $b) (local.set $a)
    (if (i32.or (i64.lt_s (local.get $a) (i64.const 0))
                (i32.or (i64.lt_s (local.get $b) (i64.const 0)) (i64.lt_s (local.get $c) (i64.const 0))))
      (then (return (i64.const -1))))
    (block $end
      (loop $l
        (br_if $end (i64.ge_s (local.get $i) (local.get $reps)))
        (if (i32.eqz (call $matmul (local.get $a) (local.get $b) (local.get $c)
                                   (local.get $n) (local.get $n) (local.get $n)))
          (then (local.set $done (i64.add (local.get $done) (i64.const 1)))))
        (local.set $i (i64.add (local.get $i) (i64.const 1)))
        (br $l)))
    (local.get $done))

  (func (export "small_op") (param $n i64) (result i32)
    (local $a i64) (local $b i64) (local $c i64)
    (call $buffers (local.get $n))
    (local.set $c) (local.set $b) (local.set $a)
    (call $matmul (local.get $a) (local.get $b) (local.get $c) (local.get $n) (local.get $n) (local.get $n)))

  (func (export "one_gemm") (param $a i64) (param $b i64) (param $c i64) (param $n i64) (result i32)
    (call $matmul (local.get $a) (local.get $b) (local.get $c) (local.get $n) (local.get $n) (local.get $n)))

  (func (export "chatty") (param $ops i64) (param $spin i64) (param $device i32) (result i64)
    (local $buf i64) (local $i i64) (local $j i64) (local $acc i64)
    (local.set $buf (call $alloc (i64.const 256)))
    (if (i64.lt_s (local.get $buf) (i64.const 0)) (then (return (i64.const -1))))
    (block $end
      (loop $op
        (br_if $end (i64.ge_s (local.get $i) (local.get $ops)))
        (drop (call $fill (local.get $buf) (f32.const 1)
                    (select (i64.const 64) (i64.const 0) (local.get $device))))
        (local.set $j (i64.const 0))
        (block $host
          (loop $work
            (br_if $host (i64.ge_s (local.get $j) (local.get $spin)))
            (local.set $acc (i64.add (i64.mul (local.get $acc) (i64.const 31)) (local.get $j)))
            (local.set $j (i64.add (local.get $j) (i64.const 1)))
            (br $work)))
        (local.set $i (i64.add (local.get $i) (i64.const 1)))
        (br $op)))
    (i64.add (local.get $i) (i64.mul (local.get $acc) (i64.const 0))))
)
