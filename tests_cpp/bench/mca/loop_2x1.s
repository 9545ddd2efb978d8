# tile 2x1: 8 SMMLA per 8-k slice, 32 slices per iteration (extracted by mca.sh from objdump -d of the kernel object)
loop:
  ld1 {v0.16b, v1.16b}, [x18], x2
  ld1 {v4.16b-v7.16b}, [x1], x2
  smmla v8.4s, v0.16b, v4.16b
  smmla v9.4s, v0.16b, v5.16b
  smmla v10.4s, v0.16b, v6.16b
  smmla v11.4s, v0.16b, v7.16b
  smmla v12.4s, v1.16b, v4.16b
  smmla v13.4s, v1.16b, v5.16b
  smmla v14.4s, v1.16b, v6.16b
  smmla v15.4s, v1.16b, v7.16b
  ld1 {v0.16b, v1.16b}, [x18], x2
  ld1 {v4.16b-v7.16b}, [x1], x2
  smmla v8.4s, v0.16b, v4.16b
  smmla v9.4s, v0.16b, v5.16b
  smmla v10.4s, v0.16b, v6.16b
  smmla v11.4s, v0.16b, v7.16b
  smmla v12.4s, v1.16b, v4.16b
  smmla v13.4s, v1.16b, v5.16b
  smmla v14.4s, v1.16b, v6.16b
  smmla v15.4s, v1.16b, v7.16b
  ld1 {v0.16b, v1.16b}, [x18], x2
  ld1 {v4.16b-v7.16b}, [x1], x2
  smmla v8.4s, v0.16b, v4.16b
  smmla v9.4s, v0.16b, v5.16b
  smmla v10.4s, v0.16b, v6.16b
  smmla v11.4s, v0.16b, v7.16b
  smmla v12.4s, v1.16b, v4.16b
  smmla v13.4s, v1.16b, v5.16b
  smmla v14.4s, v1.16b, v6.16b
  smmla v15.4s, v1.16b, v7.16b
  ld1 {v0.16b, v1.16b}, [x18], x2
  ld1 {v4.16b-v7.16b}, [x1], x2
  smmla v8.4s, v0.16b, v4.16b
  smmla v9.4s, v0.16b, v5.16b
  smmla v10.4s, v0.16b, v6.16b
  smmla v11.4s, v0.16b, v7.16b
  smmla v12.4s, v1.16b, v4.16b
  smmla v13.4s, v1.16b, v5.16b
  smmla v14.4s, v1.16b, v6.16b
  smmla v15.4s, v1.16b, v7.16b
  ld1 {v0.16b, v1.16b}, [x18], x2
  ld1 {v4.16b-v7.16b}, [x1], x2
  smmla v8.4s, v0.16b, v4.16b
  smmla v9.4s, v0.16b, v5.16b
  smmla v10.4s, v0.16b, v6.16b
  smmla v11.4s, v0.16b, v7.16b
  smmla v12.4s, v1.16b, v4.16b
  smmla v13.4s, v1.16b, v5.16b
  smmla v14.4s, v1.16b, v6.16b
  smmla v15.4s, v1.16b, v7.16b
  ld1 {v0.16b, v1.16b}, [x18], x2
  ld1 {v4.16b-v7.16b}, [x1], x2
  smmla v8.4s, v0.16b, v4.16b
  smmla v9.4s, v0.16b, v5.16b
  smmla v10.4s, v0.16b, v6.16b
  smmla v11.4s, v0.16b, v7.16b
  smmla v12.4s, v1.16b, v4.16b
  smmla v13.4s, v1.16b, v5.16b
  smmla v14.4s, v1.16b, v6.16b
  smmla v15.4s, v1.16b, v7.16b
  ld1 {v0.16b, v1.16b}, [x18], x2
  ld1 {v4.16b-v7.16b}, [x1], x2
  smmla v8.4s, v0.16b, v4.16b
  smmla v9.4s, v0.16b, v5.16b
  smmla v10.4s, v0.16b, v6.16b
  smmla v11.4s, v0.16b, v7.16b
  smmla v12.4s, v1.16b, v4.16b
  smmla v13.4s, v1.16b, v5.16b
  smmla v14.4s, v1.16b, v6.16b
  smmla v15.4s, v1.16b, v7.16b
  ld1 {v0.16b, v1.16b}, [x18], x2
  ld1 {v4.16b-v7.16b}, [x1], x2
  smmla v8.4s, v0.16b, v4.16b
  smmla v9.4s, v0.16b, v5.16b
  smmla v10.4s, v0.16b, v6.16b
  smmla v11.4s, v0.16b, v7.16b
  smmla v12.4s, v1.16b, v4.16b
  smmla v13.4s, v1.16b, v5.16b
  smmla v14.4s, v1.16b, v6.16b
  smmla v15.4s, v1.16b, v7.16b
  ld1 {v0.16b, v1.16b}, [x18], x2
  ld1 {v4.16b-v7.16b}, [x1], x2
  smmla v8.4s, v0.16b, v4.16b
  smmla v9.4s, v0.16b, v5.16b
  smmla v10.4s, v0.16b, v6.16b
  smmla v11.4s, v0.16b, v7.16b
  smmla v12.4s, v1.16b, v4.16b
  smmla v13.4s, v1.16b, v5.16b
  smmla v14.4s, v1.16b, v6.16b
  smmla v15.4s, v1.16b, v7.16b
  ld1 {v0.16b, v1.16b}, [x18], x2
  ld1 {v4.16b-v7.16b}, [x1], x2
  smmla v8.4s, v0.16b, v4.16b
  smmla v9.4s, v0.16b, v5.16b
  smmla v10.4s, v0.16b, v6.16b
  smmla v11.4s, v0.16b, v7.16b
  smmla v12.4s, v1.16b, v4.16b
  smmla v13.4s, v1.16b, v5.16b
  smmla v14.4s, v1.16b, v6.16b
  smmla v15.4s, v1.16b, v7.16b
  ld1 {v0.16b, v1.16b}, [x18], x2
  ld1 {v4.16b-v7.16b}, [x1], x2
  smmla v8.4s, v0.16b, v4.16b
  smmla v9.4s, v0.16b, v5.16b
  smmla v10.4s, v0.16b, v6.16b
  smmla v11.4s, v0.16b, v7.16b
  smmla v12.4s, v1.16b, v4.16b
  smmla v13.4s, v1.16b, v5.16b
  smmla v14.4s, v1.16b, v6.16b
  smmla v15.4s, v1.16b, v7.16b
  ld1 {v0.16b, v1.16b}, [x18], x2
  ld1 {v4.16b-v7.16b}, [x1], x2
  smmla v8.4s, v0.16b, v4.16b
  smmla v9.4s, v0.16b, v5.16b
  smmla v10.4s, v0.16b, v6.16b
  smmla v11.4s, v0.16b, v7.16b
  smmla v12.4s, v1.16b, v4.16b
  smmla v13.4s, v1.16b, v5.16b
  smmla v14.4s, v1.16b, v6.16b
  smmla v15.4s, v1.16b, v7.16b
  ld1 {v0.16b, v1.16b}, [x18], x2
  ld1 {v4.16b-v7.16b}, [x1], x2
  smmla v8.4s, v0.16b, v4.16b
  smmla v9.4s, v0.16b, v5.16b
  smmla v10.4s, v0.16b, v6.16b
  smmla v11.4s, v0.16b, v7.16b
  smmla v12.4s, v1.16b, v4.16b
  smmla v13.4s, v1.16b, v5.16b
  smmla v14.4s, v1.16b, v6.16b
  smmla v15.4s, v1.16b, v7.16b
  ld1 {v0.16b, v1.16b}, [x18], x2
  ld1 {v4.16b-v7.16b}, [x1], x2
  smmla v8.4s, v0.16b, v4.16b
  smmla v9.4s, v0.16b, v5.16b
  smmla v10.4s, v0.16b, v6.16b
  smmla v11.4s, v0.16b, v7.16b
  smmla v12.4s, v1.16b, v4.16b
  smmla v13.4s, v1.16b, v5.16b
  smmla v14.4s, v1.16b, v6.16b
  smmla v15.4s, v1.16b, v7.16b
  ld1 {v0.16b, v1.16b}, [x18], x2
  ld1 {v4.16b-v7.16b}, [x1], x2
  smmla v8.4s, v0.16b, v4.16b
  smmla v9.4s, v0.16b, v5.16b
  smmla v10.4s, v0.16b, v6.16b
  smmla v11.4s, v0.16b, v7.16b
  smmla v12.4s, v1.16b, v4.16b
  smmla v13.4s, v1.16b, v5.16b
  smmla v14.4s, v1.16b, v6.16b
  smmla v15.4s, v1.16b, v7.16b
  ld1 {v0.16b, v1.16b}, [x18], x2
  ld1 {v4.16b-v7.16b}, [x1], x2
  smmla v8.4s, v0.16b, v4.16b
  smmla v9.4s, v0.16b, v5.16b
  smmla v10.4s, v0.16b, v6.16b
  smmla v11.4s, v0.16b, v7.16b
  smmla v12.4s, v1.16b, v4.16b
  smmla v13.4s, v1.16b, v5.16b
  smmla v14.4s, v1.16b, v6.16b
  smmla v15.4s, v1.16b, v7.16b
  ld1 {v0.16b, v1.16b}, [x18], x2
  ld1 {v4.16b-v7.16b}, [x1], x2
  smmla v8.4s, v0.16b, v4.16b
  smmla v9.4s, v0.16b, v5.16b
  smmla v10.4s, v0.16b, v6.16b
  smmla v11.4s, v0.16b, v7.16b
  smmla v12.4s, v1.16b, v4.16b
  smmla v13.4s, v1.16b, v5.16b
  smmla v14.4s, v1.16b, v6.16b
  smmla v15.4s, v1.16b, v7.16b
  ld1 {v0.16b, v1.16b}, [x18], x2
  ld1 {v4.16b-v7.16b}, [x1], x2
  smmla v8.4s, v0.16b, v4.16b
  smmla v9.4s, v0.16b, v5.16b
  smmla v10.4s, v0.16b, v6.16b
  smmla v11.4s, v0.16b, v7.16b
  smmla v12.4s, v1.16b, v4.16b
  smmla v13.4s, v1.16b, v5.16b
  smmla v14.4s, v1.16b, v6.16b
  smmla v15.4s, v1.16b, v7.16b
  ld1 {v0.16b, v1.16b}, [x18], x2
  ld1 {v4.16b-v7.16b}, [x1], x2
  smmla v8.4s, v0.16b, v4.16b
  smmla v9.4s, v0.16b, v5.16b
  smmla v10.4s, v0.16b, v6.16b
  smmla v11.4s, v0.16b, v7.16b
  smmla v12.4s, v1.16b, v4.16b
  smmla v13.4s, v1.16b, v5.16b
  smmla v14.4s, v1.16b, v6.16b
  smmla v15.4s, v1.16b, v7.16b
  ld1 {v0.16b, v1.16b}, [x18], x2
  ld1 {v4.16b-v7.16b}, [x1], x2
  smmla v8.4s, v0.16b, v4.16b
  smmla v9.4s, v0.16b, v5.16b
  smmla v10.4s, v0.16b, v6.16b
  smmla v11.4s, v0.16b, v7.16b
  smmla v12.4s, v1.16b, v4.16b
  smmla v13.4s, v1.16b, v5.16b
  smmla v14.4s, v1.16b, v6.16b
  smmla v15.4s, v1.16b, v7.16b
  ld1 {v0.16b, v1.16b}, [x18], x2
  ld1 {v4.16b-v7.16b}, [x1], x2
  smmla v8.4s, v0.16b, v4.16b
  smmla v9.4s, v0.16b, v5.16b
  smmla v10.4s, v0.16b, v6.16b
  smmla v11.4s, v0.16b, v7.16b
  smmla v12.4s, v1.16b, v4.16b
  smmla v13.4s, v1.16b, v5.16b
  smmla v14.4s, v1.16b, v6.16b
  smmla v15.4s, v1.16b, v7.16b
  ld1 {v0.16b, v1.16b}, [x18], x2
  ld1 {v4.16b-v7.16b}, [x1], x2
  smmla v8.4s, v0.16b, v4.16b
  smmla v9.4s, v0.16b, v5.16b
  smmla v10.4s, v0.16b, v6.16b
  smmla v11.4s, v0.16b, v7.16b
  smmla v12.4s, v1.16b, v4.16b
  smmla v13.4s, v1.16b, v5.16b
  smmla v14.4s, v1.16b, v6.16b
  smmla v15.4s, v1.16b, v7.16b
  ld1 {v0.16b, v1.16b}, [x18], x2
  ld1 {v4.16b-v7.16b}, [x1], x2
  smmla v8.4s, v0.16b, v4.16b
  smmla v9.4s, v0.16b, v5.16b
  smmla v10.4s, v0.16b, v6.16b
  smmla v11.4s, v0.16b, v7.16b
  smmla v12.4s, v1.16b, v4.16b
  smmla v13.4s, v1.16b, v5.16b
  smmla v14.4s, v1.16b, v6.16b
  smmla v15.4s, v1.16b, v7.16b
  ld1 {v0.16b, v1.16b}, [x18], x2
  ld1 {v4.16b-v7.16b}, [x1], x2
  smmla v8.4s, v0.16b, v4.16b
  smmla v9.4s, v0.16b, v5.16b
  smmla v10.4s, v0.16b, v6.16b
  smmla v11.4s, v0.16b, v7.16b
  smmla v12.4s, v1.16b, v4.16b
  smmla v13.4s, v1.16b, v5.16b
  smmla v14.4s, v1.16b, v6.16b
  smmla v15.4s, v1.16b, v7.16b
  ld1 {v0.16b, v1.16b}, [x18], x2
  ld1 {v4.16b-v7.16b}, [x1], x2
  smmla v8.4s, v0.16b, v4.16b
  smmla v9.4s, v0.16b, v5.16b
  smmla v10.4s, v0.16b, v6.16b
  smmla v11.4s, v0.16b, v7.16b
  smmla v12.4s, v1.16b, v4.16b
  smmla v13.4s, v1.16b, v5.16b
  smmla v14.4s, v1.16b, v6.16b
  smmla v15.4s, v1.16b, v7.16b
  ld1 {v0.16b, v1.16b}, [x18], x2
  ld1 {v4.16b-v7.16b}, [x1], x2
  smmla v8.4s, v0.16b, v4.16b
  smmla v9.4s, v0.16b, v5.16b
  smmla v10.4s, v0.16b, v6.16b
  smmla v11.4s, v0.16b, v7.16b
  smmla v12.4s, v1.16b, v4.16b
  smmla v13.4s, v1.16b, v5.16b
  smmla v14.4s, v1.16b, v6.16b
  smmla v15.4s, v1.16b, v7.16b
  ld1 {v0.16b, v1.16b}, [x18], x2
  ld1 {v4.16b-v7.16b}, [x1], x2
  smmla v8.4s, v0.16b, v4.16b
  smmla v9.4s, v0.16b, v5.16b
  smmla v10.4s, v0.16b, v6.16b
  smmla v11.4s, v0.16b, v7.16b
  smmla v12.4s, v1.16b, v4.16b
  smmla v13.4s, v1.16b, v5.16b
  smmla v14.4s, v1.16b, v6.16b
  smmla v15.4s, v1.16b, v7.16b
  ld1 {v0.16b, v1.16b}, [x18], x2
  ld1 {v4.16b-v7.16b}, [x1], x2
  smmla v8.4s, v0.16b, v4.16b
  smmla v9.4s, v0.16b, v5.16b
  smmla v10.4s, v0.16b, v6.16b
  smmla v11.4s, v0.16b, v7.16b
  smmla v12.4s, v1.16b, v4.16b
  smmla v13.4s, v1.16b, v5.16b
  smmla v14.4s, v1.16b, v6.16b
  smmla v15.4s, v1.16b, v7.16b
  ld1 {v0.16b, v1.16b}, [x18], x2
  ld1 {v4.16b-v7.16b}, [x1], x2
  smmla v8.4s, v0.16b, v4.16b
  smmla v9.4s, v0.16b, v5.16b
  smmla v10.4s, v0.16b, v6.16b
  smmla v11.4s, v0.16b, v7.16b
  smmla v12.4s, v1.16b, v4.16b
  smmla v13.4s, v1.16b, v5.16b
  smmla v14.4s, v1.16b, v6.16b
  smmla v15.4s, v1.16b, v7.16b
  ld1 {v0.16b, v1.16b}, [x18], x2
  ld1 {v4.16b-v7.16b}, [x1], x2
  smmla v8.4s, v0.16b, v4.16b
  smmla v9.4s, v0.16b, v5.16b
  smmla v10.4s, v0.16b, v6.16b
  smmla v11.4s, v0.16b, v7.16b
  smmla v12.4s, v1.16b, v4.16b
  smmla v13.4s, v1.16b, v5.16b
  smmla v14.4s, v1.16b, v6.16b
  smmla v15.4s, v1.16b, v7.16b
  ld1 {v0.16b, v1.16b}, [x18], x2
  ld1 {v4.16b-v7.16b}, [x1], x2
  smmla v8.4s, v0.16b, v4.16b
  smmla v9.4s, v0.16b, v5.16b
  smmla v10.4s, v0.16b, v6.16b
  smmla v11.4s, v0.16b, v7.16b
  smmla v12.4s, v1.16b, v4.16b
  smmla v13.4s, v1.16b, v5.16b
  smmla v14.4s, v1.16b, v6.16b
  smmla v15.4s, v1.16b, v7.16b
  ld1 {v0.16b, v1.16b}, [x18], x2
  ld1 {v4.16b-v7.16b}, [x1], x2
  smmla v8.4s, v0.16b, v4.16b
  smmla v9.4s, v0.16b, v5.16b
  smmla v10.4s, v0.16b, v6.16b
  smmla v11.4s, v0.16b, v7.16b
  smmla v12.4s, v1.16b, v4.16b
  smmla v13.4s, v1.16b, v5.16b
  smmla v14.4s, v1.16b, v6.16b
  smmla v15.4s, v1.16b, v7.16b
  subs x19, x19, #0x1
  b.ne loop
