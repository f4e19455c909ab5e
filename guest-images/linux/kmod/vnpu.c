// SPDX-License-Identifier: GPL-2.0
/*
 * vnpu: the kernel half of the vNPU's Linux user-space driver
 * (docs/linux-guests.md). It binds the vNPU PCI function (5650:0001),
 * enables it with bus mastering, allocates one MSI-X vector for ring
 * completions and counts them; user space maps BAR 0 through sysfs as
 * before and sleeps on completions by reading /dev/vnpu-BB:DD.F:
 *
 *   read(fd, &u32, 4)  blocks until the completion count differs from the
 *                      value this file last returned, then returns it
 *                      (O_NONBLOCK: -EAGAIN instead of blocking).
 *
 * An event count, so a completion between user space's last look at the
 * ring and its read is never lost. DMA memory of any size for programs
 * that need more than a huge page (vnpu-infer):
 *
 *   mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
 *                      allocates a physically contiguous, zeroed buffer of
 *                      len bytes for this open file (dma_alloc_coherent;
 *                      above 4 MiB it comes from the CMA area: boot with
 *                      cma=SIZE, on a kernel built with CONFIG_CMA) and
 *                      maps it; one buffer per open file (-EBUSY for a
 *                      second), freed when the file is closed and
 *                      unmapped. When dma_alloc_coherent cannot give the
 *                      buffer and memory was reserved for the module
 *                      (below), it comes from there.
 *   ioctl(fd, VNPU_IOC_DMA_ADDR, &u64)
 *                      the buffer's bus address (-ENODATA before mmap).
 *
 * Reserved memory, for kernels without CMA (Debian's): boot with
 * memmap=SIZE$BASE (the kernel leaves those bytes of RAM alone) and load
 * the module with reserve=SIZE@BASE (the same range): it maps the range
 * and hands out physically contiguous buffers of any size from it. Such
 * a buffer is mapped for the function with the DMA API (dma_map_page
 * where the range has struct pages, as memmap= RAM does; else
 * dma_map_resource): its bus address is its physical address without an
 * IOMMU, and an address the IOMMU translates with one (intel_iommu=on
 * behind QEMU's vIOMMU).
 *
 * Everything else (ring, mailbox) stays in user space.
 */
#include <linux/atomic.h>
#include <linux/dma-mapping.h>
#include <linux/ioctl.h>
#include <linux/mm.h>
#include <linux/mutex.h>
#include <linux/dma-direct.h>
#include <linux/fs.h>
#include <linux/genalloc.h>
#include <linux/interrupt.h>
#include <linux/io.h>
#include <linux/ioport.h>
#include <linux/miscdevice.h>
#include <linux/module.h>
#include <linux/pci.h>
#include <linux/poll.h>
#include <linux/slab.h>
#include <linux/uaccess.h>
#include <linux/wait.h>

#define VNPU_VENDOR 0x5650
#define VNPU_DEVICE 0x0001
#define VNPU_IOC_DMA_ADDR _IOR('v', 1, __u64)

/* reserve=SIZE@BASE: memory the kernel was told to leave alone (memmap=). */
static char *reserve;
module_param(reserve, charp, 0444);
MODULE_PARM_DESC(reserve, "SIZE@BASE of RAM reserved with memmap=SIZE$BASE: DMA buffers of any size");

/* The reserved range, mapped, and its allocator (NULL: none). */
static struct gen_pool *reserved_pool;
static void *reserved_virt;

struct vnpu {
	struct pci_dev *pdev;
	struct miscdevice misc;
	char name[32];
	atomic_t completions;
	wait_queue_head_t wait;
};

struct vnpu_file {
	struct vnpu *v;
	u32 last;
	/* The file's DMA buffer (mmap), guarded by lock. */
	struct mutex lock;
	void *cpu;
	dma_addr_t bus;
	size_t len;
	/* Whether cpu is from reserved_pool rather than dma_alloc_coherent. */
	bool reserved;
};

static irqreturn_t vnpu_irq(int irq, void *data)
{
	struct vnpu *v = data;

	atomic_inc(&v->completions);
	wake_up_interruptible(&v->wait);
	return IRQ_HANDLED;
}

static int vnpu_open(struct inode *inode, struct file *f)
{
	struct vnpu *v = container_of(f->private_data, struct vnpu, misc);
	struct vnpu_file *vf = kzalloc(sizeof(*vf), GFP_KERNEL);

	if (!vf)
		return -ENOMEM;
	vf->v = v;
	vf->last = atomic_read(&v->completions);
	mutex_init(&vf->lock);
	f->private_data = vf;
	return 0;
}

/* The reserved range's RAM has struct pages (memmap= leaves it in the
 * kernel's memory map as reserved), and dma_map_resource refuses RAM. */
static bool reserved_has_pages;

static dma_addr_t vnpu_map_reserved(struct device *dev, phys_addr_t phys, size_t len)
{
	if (reserved_has_pages)
		return dma_map_page(dev, pfn_to_page(PHYS_PFN(phys)), offset_in_page(phys), len,
				    DMA_BIDIRECTIONAL);
	return dma_map_resource(dev, phys, len, DMA_BIDIRECTIONAL, 0);
}

static void vnpu_unmap_reserved(struct device *dev, dma_addr_t bus, size_t len)
{
	if (reserved_has_pages)
		dma_unmap_page(dev, bus, len, DMA_BIDIRECTIONAL);
	else
		dma_unmap_resource(dev, bus, len, DMA_BIDIRECTIONAL, 0);
}

static int vnpu_release(struct inode *inode, struct file *f)
{
	struct vnpu_file *vf = f->private_data;

	/* The last mapping is gone too: a mapping holds the file. */
	if (vf->cpu && vf->reserved) {
		vnpu_unmap_reserved(&vf->v->pdev->dev, vf->bus, vf->len);
		gen_pool_free(reserved_pool, (unsigned long)vf->cpu, vf->len);
	}
	else if (vf->cpu)
		dma_free_coherent(&vf->v->pdev->dev, vf->len, vf->cpu, vf->bus);
	kfree(vf);
	return 0;
}

static int vnpu_mmap(struct file *f, struct vm_area_struct *vma)
{
	struct vnpu_file *vf = f->private_data;
	struct device *dev = &vf->v->pdev->dev;
	size_t len = vma->vm_end - vma->vm_start;
	int ret;

	if (vma->vm_pgoff || !len)
		return -EINVAL;
	mutex_lock(&vf->lock);
	if (vf->cpu) {
		ret = -EBUSY;
		goto out;
	}
	/* Quietly: a buffer above the buddy allocator's 4 MiB fails here
	 * without CMA, and the reserved range is asked next. */
	vf->cpu = dma_alloc_coherent(dev, len, &vf->bus, GFP_KERNEL | __GFP_NOWARN);
	if (vf->cpu) {
		vf->len = len;
		ret = dma_mmap_coherent(dev, vma, vf->cpu, vf->bus, len);
		if (ret) {
			dma_free_coherent(dev, len, vf->cpu, vf->bus);
			vf->cpu = NULL;
		}
		goto out;
	}
	if (!reserved_pool) {
		ret = -ENOMEM;
		goto out;
	}
	vf->cpu = (void *)gen_pool_alloc(reserved_pool, len);
	if (!vf->cpu) {
		ret = -ENOMEM;
		goto out;
	}
	memset(vf->cpu, 0, len);
	{
		phys_addr_t phys = gen_pool_virt_to_phys(reserved_pool, (unsigned long)vf->cpu);

		vf->bus = vnpu_map_reserved(dev, phys, len);
		if (dma_mapping_error(dev, vf->bus)) {
			gen_pool_free(reserved_pool, (unsigned long)vf->cpu, len);
			vf->cpu = NULL;
			ret = -ENOMEM;
			goto out;
		}
		vf->len = len;
		vf->reserved = true;
		ret = remap_pfn_range(vma, vma->vm_start, PHYS_PFN(phys), len, vma->vm_page_prot);
	}
	if (ret) {
		vnpu_unmap_reserved(dev, vf->bus, len);
		gen_pool_free(reserved_pool, (unsigned long)vf->cpu, len);
		vf->cpu = NULL;
		vf->reserved = false;
	}
out:
	mutex_unlock(&vf->lock);
	return ret;
}

static long vnpu_ioctl(struct file *f, unsigned int cmd, unsigned long arg)
{
	struct vnpu_file *vf = f->private_data;
	u64 bus;

	if (cmd != VNPU_IOC_DMA_ADDR)
		return -ENOTTY;
	mutex_lock(&vf->lock);
	bus = vf->bus;
	if (!vf->cpu) {
		mutex_unlock(&vf->lock);
		return -ENODATA;
	}
	mutex_unlock(&vf->lock);
	if (copy_to_user((void __user *)arg, &bus, sizeof(bus)))
		return -EFAULT;
	return 0;
}

static ssize_t vnpu_read(struct file *f, char __user *buf, size_t len, loff_t *off)
{
	struct vnpu_file *vf = f->private_data;
	struct vnpu *v = vf->v;
	u32 now;
	int ret;

	if (len < sizeof(u32))
		return -EINVAL;
	if (f->f_flags & O_NONBLOCK) {
		if ((u32)atomic_read(&v->completions) == vf->last)
			return -EAGAIN;
	} else {
		ret = wait_event_interruptible(v->wait, (u32)atomic_read(&v->completions) != vf->last);
		if (ret)
			return ret;
	}
	now = atomic_read(&v->completions);
	vf->last = now;
	if (copy_to_user(buf, &now, sizeof(now)))
		return -EFAULT;
	return sizeof(now);
}

static __poll_t vnpu_poll(struct file *f, poll_table *pt)
{
	struct vnpu_file *vf = f->private_data;

	poll_wait(f, &vf->v->wait, pt);
	return (u32)atomic_read(&vf->v->completions) != vf->last ? EPOLLIN | EPOLLRDNORM : 0;
}

static const struct file_operations vnpu_fops = {
	.owner = THIS_MODULE,
	.open = vnpu_open,
	.release = vnpu_release,
	.read = vnpu_read,
	.poll = vnpu_poll,
	.mmap = vnpu_mmap,
	.unlocked_ioctl = vnpu_ioctl,
	.llseek = noop_llseek,
};

static int vnpu_probe(struct pci_dev *pdev, const struct pci_device_id *id)
{
	struct vnpu *v;
	int ret;

	v = devm_kzalloc(&pdev->dev, sizeof(*v), GFP_KERNEL);
	if (!v)
		return -ENOMEM;
	ret = pcim_enable_device(pdev);
	if (ret)
		return ret;
	pci_set_master(pdev);
	ret = dma_set_mask_and_coherent(&pdev->dev, DMA_BIT_MASK(64));
	if (ret)
		return ret;
	ret = pci_alloc_irq_vectors(pdev, 1, 1, PCI_IRQ_MSIX);
	if (ret < 0) {
		dev_err(&pdev->dev, "no MSI-X vector: %d\n", ret);
		return ret;
	}
	v->pdev = pdev;
	atomic_set(&v->completions, 0);
	init_waitqueue_head(&v->wait);
	snprintf(v->name, sizeof(v->name), "vnpu-%s", pci_name(pdev));
	ret = request_irq(pci_irq_vector(pdev, 0), vnpu_irq, 0, v->name, v);
	if (ret)
		goto free_vectors;
	v->misc.minor = MISC_DYNAMIC_MINOR;
	v->misc.name = v->name;
	v->misc.fops = &vnpu_fops;
	v->misc.parent = &pdev->dev;
	ret = misc_register(&v->misc);
	if (ret)
		goto free_irq;
	pci_set_drvdata(pdev, v);
	dev_info(&pdev->dev, "MSI-X vector 0 on IRQ %d; completions on /dev/%s\n",
		 pci_irq_vector(pdev, 0), v->name);
	return 0;
free_irq:
	free_irq(pci_irq_vector(pdev, 0), v);
free_vectors:
	pci_free_irq_vectors(pdev);
	return ret;
}

static void vnpu_remove(struct pci_dev *pdev)
{
	struct vnpu *v = pci_get_drvdata(pdev);

	misc_deregister(&v->misc);
	free_irq(pci_irq_vector(pdev, 0), v);
	pci_free_irq_vectors(pdev);
}

static const struct pci_device_id vnpu_ids[] = {
	{ PCI_DEVICE(VNPU_VENDOR, VNPU_DEVICE) },
	{ 0 }
};
MODULE_DEVICE_TABLE(pci, vnpu_ids);

static struct pci_driver vnpu_driver = {
	.name = "vnpu",
	.id_table = vnpu_ids,
	.probe = vnpu_probe,
	.remove = vnpu_remove,
};

/* Gives back what vnpu_reserve took (nothing if it took nothing). */
static void vnpu_unreserve(void)
{
	if (reserved_pool)
		gen_pool_destroy(reserved_pool);
	reserved_pool = NULL;
	if (reserved_virt)
		memunmap(reserved_virt);
	reserved_virt = NULL;
}

/* Maps reserve=SIZE@BASE and makes a page-granular allocator of it. */
static int vnpu_reserve(void)
{
	unsigned long long size, base;
	unsigned long pfn;
	char *at;

	if (!reserve || !*reserve)
		return 0;
	size = memparse(reserve, &at);
	if (*at != '@' || !size) {
		pr_err("vnpu: reserve=%s: want SIZE@BASE\n", reserve);
		return -EINVAL;
	}
	base = memparse(at + 1, &at);
	if (*at || !PAGE_ALIGNED(base) || !PAGE_ALIGNED(size) || base + size < base) {
		pr_err("vnpu: reserve=%s: want page-aligned SIZE@BASE\n", reserve);
		return -EINVAL;
	}
	/* RAM the kernel still owns would be handed out twice. */
	if (region_intersects(base, size, IORESOURCE_SYSTEM_RAM, IORES_DESC_NONE) != REGION_DISJOINT) {
		pr_err("vnpu: reserve=%s is System RAM: boot with memmap=%llu$%#llx\n", reserve, size, base);
		return -EINVAL;
	}
	reserved_virt = memremap(base, size, MEMREMAP_WB);
	if (!reserved_virt)
		return -ENOMEM;
	reserved_pool = gen_pool_create(PAGE_SHIFT, -1);
	if (!reserved_pool || gen_pool_add_virt(reserved_pool, (unsigned long)reserved_virt, base, size, -1)) {
		vnpu_unreserve();
		return -ENOMEM;
	}
	reserved_has_pages = true;
	for (pfn = PHYS_PFN(base); pfn < PHYS_PFN(base + size); pfn++)
		reserved_has_pages &= pfn_valid(pfn);
	pr_info("vnpu: %llu KiB of reserved memory at %#llx for DMA buffers (%s)\n", size >> 10, base,
		reserved_has_pages ? "struct pages" : "no struct pages");
	return 0;
}

static int __init vnpu_init(void)
{
	int ret = vnpu_reserve();

	if (ret)
		return ret;
	ret = pci_register_driver(&vnpu_driver);
	if (ret)
		vnpu_unreserve();
	return ret;
}

static void __exit vnpu_exit(void)
{
	pci_unregister_driver(&vnpu_driver);
	vnpu_unreserve();
}
module_init(vnpu_init);
module_exit(vnpu_exit);

MODULE_DESCRIPTION("vNPU: MSI-X completions and DMA memory for the user-space driver");
MODULE_LICENSE("GPL");
